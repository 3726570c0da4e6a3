"""Per-prompt sampling: a data row may cap its own response length below the configured one, and a
prompt's group may get sampling seeds from its place in the prompt stream.

A row's `extra_info.max_tokens` (validated when the row is read) lowers `rollout.sampling.max_tokens`
for that prompt's group: curricula and length-controlled datasets set it per row.
"""

from __future__ import annotations

import dataclasses

from asyncrl.config.rollout import SamplingConfig
from asyncrl.data import PromptRow
from asyncrl.data.rows import ROW_MAX_TOKENS_KEY

SEED_MODULUS = 2**31 - 1  # vLLM takes sampling seeds as 32-bit signed ints


def sampling_for_row(row: PromptRow, sampling: SamplingConfig) -> SamplingConfig:
    """`sampling`, with the row's own response-length cap where it sets a lower one."""
    cap = row.extra_info.get(ROW_MAX_TOKENS_KEY)
    if cap is None or cap >= sampling.max_tokens:
        return sampling
    return dataclasses.replace(sampling, max_tokens=cap)


def group_seed(seed_base: int, number: int, n: int, seeded: bool) -> int | None:
    """Sampling seed of the `number`-th prompt group of a stream whose seeds start at `seed_base` (its `n`
    samples use this + their index, so groups never share a seed): it follows the prompt stream, so a
    rerun, or a regeneration after a restart, samples the same completions. None when not `seeded`."""
    if not seeded:
        return None
    return (seed_base + number * n) % SEED_MODULUS


def sample_seeds(seed: int | None, n: int) -> list[int | None]:
    """The seeds of a group's `n` samples: the group's seed + the sample's index (None stays unseeded)."""
    return [None if seed is None else seed + index for index in range(n)]
