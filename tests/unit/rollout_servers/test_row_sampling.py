"""A row's own `extra_info.max_tokens` lowers the configured response length for that prompt only."""

from asyncrl.config.rollout import SamplingConfig
from asyncrl.data import PromptRow
from rollout_servers.row_sampling import sampling_for_row

CONFIGURED = SamplingConfig(max_tokens=128, n=4, temperature=0.7)


def row(**extra_info) -> PromptRow:
    return PromptRow([{"role": "user", "content": "1+1"}], "arithmetic", "2", extra_info=extra_info)


def test_lower_row_cap_replaces_max_tokens_and_keeps_the_rest():
    sampling = sampling_for_row(row(max_tokens=17), CONFIGURED)
    assert sampling.max_tokens == 17
    assert (sampling.n, sampling.temperature) == (CONFIGURED.n, CONFIGURED.temperature)
    assert CONFIGURED.max_tokens == 128  # the shared config is not modified


def test_row_without_cap_or_with_a_higher_one_keeps_the_config():
    assert sampling_for_row(row(), CONFIGURED) is CONFIGURED
    assert sampling_for_row(row(max_tokens=4096), CONFIGURED).max_tokens == 128
