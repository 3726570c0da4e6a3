"""The per-update warning about a rotary embedding's computed cache is dropped; vLLM's other warnings stay."""

import logging

from rollout_servers.vllm_log_filters import LAYERWISE_LOGGER, drop_expected_warnings


def test_only_the_rotary_cache_warning_is_dropped(caplog):
    drop_expected_warnings()
    drop_expected_warnings()  # idempotent: the plugin loader may run twice
    logger = logging.getLogger(LAYERWISE_LOGGER)
    with caplog.at_level(logging.WARNING, logger=LAYERWISE_LOGGER):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    assert [record.getMessage() for record in caplog.records] == ["QKVParallelLinear: Failed to load weights"]
    assert sum(1 for _ in logger.filters) == 1
