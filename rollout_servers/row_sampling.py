"""Per-prompt sampling: a data row may cap its own response length below the configured one.

A row's `extra_info.max_tokens` (validated when the row is read) lowers `rollout.sampling.max_tokens`
for that prompt's group: curricula and length-controlled datasets set it per row.
"""

from __future__ import annotations

import dataclasses

from asyncrl.config.rollout import SamplingConfig
from asyncrl.data import PromptRow
from asyncrl.data.rows import ROW_MAX_TOKENS_KEY


def sampling_for_row(row: PromptRow, sampling: SamplingConfig) -> SamplingConfig:
    """`sampling`, with the row's own response-length cap where it sets a lower one."""
    cap = row.extra_info.get(ROW_MAX_TOKENS_KEY)
    if cap is None or cap >= sampling.max_tokens:
        return sampling
    return dataclasses.replace(sampling, max_tokens=cap)
