"""A row's own `extra_info.max_tokens` lowers the configured response length for that prompt only."""

from asyncrl.config.rollout import SamplingConfig
from asyncrl.data import PromptRow
from rollout_servers.row_sampling import SEED_MODULUS, group_seed, sampling_for_row

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


def test_group_seeds_follow_the_prompt_stream_and_never_share_a_seed_across_groups():
    n = CONFIGURED.n
    seeds = [group_seed(7, number, n, seeded=True) for number in range(3)]
    assert seeds == [7, 7 + n, 7 + 2 * n]  # samples of group k use seed_k .. seed_k + n - 1
    assert group_seed(SEED_MODULUS - 1, 1, n, seeded=True) == n - 1  # wraps into vLLM's 32-bit range


def test_unseeded_sampling_gives_no_seed():
    assert group_seed(7, 3, CONFIGURED.n, seeded=False) is None
