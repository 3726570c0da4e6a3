"""vLLM log records that say nothing wrong in a rollout server, dropped so that a healthy run's log stays quiet.

vLLM's layerwise reload (every in-flight weight update) warns "RotaryEmbedding: Failed to load weights" once
per update: a rotary embedding's only tensor is its cos/sin cache, computed from the config and never part of a
checkpoint or of the learner's weights, so nothing is ever sent for it and vLLM puts the cache back.
"""

from __future__ import annotations

import logging

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # where the reload logs
_NOT_SENT = "RotaryEmbedding: Failed to load weights"  # the end of the message for any rotary embedding class


class _ComputedCachesNotSent(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().endswith(_NOT_SENT)


def drop_expected_warnings() -> None:
    """Install the filters in this process (idempotent)."""
    logger = logging.getLogger(LAYERWISE_LOGGER)
    if not any(isinstance(existing, _ComputedCachesNotSent) for existing in logger.filters):
        logger.addFilter(_ComputedCachesNotSent())
