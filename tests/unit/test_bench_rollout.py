"""The rollout benchmark's paired ratio: per-round tokens/s ratios pooled by their geometric mean."""

import math

import pytest

from asyncrl.config import AsyncRLConfig
from scripts.bench_rollout import SEED_BASE, PhaseResult, group_seeds, paired_ratio


def phase(tokens: int, seconds: list[float]) -> PhaseResult:
    return PhaseResult("p", tokens, seconds, 0.0, 0.0, [0.0] * len(seconds), [0.0] * len(seconds))


def test_paired_ratio_is_the_geometric_mean_of_each_rounds_ratio_with_two_standard_errors():
    server, raw = phase(100, [1.0, 2.0, 4.0]), phase(100, [2.0, 2.0, 2.0])  # per round: 2, 1, 0.5
    mean, low, high = paired_ratio(server, raw)
    assert mean == pytest.approx(1.0)  # (2 · 1 · 0.5) ** (1/3)
    spread = 2 * math.log(2) / math.sqrt(3)  # the log ratios ln 2, 0, −ln 2 have standard deviation ln 2
    assert (low, high) == (pytest.approx(math.exp(-spread)), pytest.approx(math.exp(spread)))


def test_a_round_slowed_for_both_paths_does_not_move_the_paired_ratio():
    steady = paired_ratio(phase(100, [1.0, 1.0]), phase(100, [2.0, 2.0]))
    loaded = paired_ratio(phase(100, [1.0, 5.0]), phase(100, [2.0, 10.0]))  # round 2 five times slower for both
    assert steady[0] == pytest.approx(2.0) and loaded[0] == pytest.approx(2.0) and loaded[1] == pytest.approx(2.0)


def test_group_seeds_are_spaced_by_n_and_absent_when_unseeded():
    config = AsyncRLConfig()
    config.rollout.sampling.n = 4
    assert group_seeds(config, 3) == [SEED_BASE, SEED_BASE + 4, SEED_BASE + 8]
    config.rollout.seeded_sampling = False
    assert group_seeds(config, 2) == [None, None]
