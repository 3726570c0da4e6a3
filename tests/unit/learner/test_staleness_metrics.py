"""The learner's `staleness/*` of a batch (over its groups, over its trained tokens, and the start lag K bounds)
and the per-token bound, which masks tokens out of the loss instead of dropping samples; hand-computed cases."""

from __future__ import annotations

import pytest

from asyncrl.messages import Batch, Trajectory, TrajectoryGroup
from asyncrl.staleness import TOKEN_BOUND_OFF
from demo.synthetic import synthetic_group
from learner.maths.staleness import mask_stale_tokens, staleness_metrics


def batch_of(*versions: int) -> Batch:
    groups = [synthetic_group(f"r{i}", completion_tokens=2, version=v) for i, v in enumerate(versions)]
    return Batch(groups=groups, offsets=list(range(len(groups))), next_offset=len(groups))


def sample(versions: list[int], mask: list[int] | None = None) -> Trajectory:
    n = len(versions)
    return Trajectory([1, 2], list(range(3, 3 + n)), [-0.5] * n, versions, mask or [1] * n, 1.0, "g", "src", "length")


def long_and_short_batch() -> Batch:
    """Two groups started at version 4 while the learner was at 5: a long response that ran through four updates
    (versions 4..8, the learner trains it at 9) and a short one, with an environment token (mask 0) in it."""
    long = TrajectoryGroup("long", "g", "s", [sample([4, 4, 5, 6, 7, 8])], learner_version_at_start=5)
    short = TrajectoryGroup("short", "g", "s", [sample([8, 8, 8], mask=[1, 0, 1])], learner_version_at_start=8)
    return Batch(groups=[long, short], offsets=[0, 1], next_offset=2)


def test_mean_min_and_max_over_the_groups():
    metrics = staleness_metrics(batch_of(7, 5, 4).groups, version=8)
    assert {key: metrics[key] for key in ("staleness/mean", "staleness/min", "staleness/max")} == {
        "staleness/mean": 8 / 3, "staleness/min": 1.0, "staleness/max": 4.0}


def test_a_batch_trained_exactly_k_versions_old_has_min_equal_to_max():
    metrics = staleness_metrics(batch_of(6, 6, 6).groups, version=10)
    assert metrics["staleness/min"] == metrics["staleness/max"] == metrics["staleness/mean"] == 4.0


def test_token_staleness_weighs_every_trained_token_and_the_start_lag_is_what_k_bounds():
    metrics = staleness_metrics(long_and_short_batch().groups, version=9)
    # trained tokens: 5 5 4 3 2 1 (long) and 1 1 (short; the mask-0 token is left out): 22 over 8 tokens
    assert metrics["staleness/token_mean"] == pytest.approx(22 / 8) and metrics["staleness/token_max"] == 5.0
    assert (metrics["staleness/mean"], metrics["staleness/max"]) == (3.0, 5.0)  # groups: 9 - 4 and 9 - 8
    assert metrics["staleness/start_lag_max"] == 1.0  # long: started from version 4 while the learner was at 5


def test_a_group_without_a_recorded_start_has_no_start_lag():
    assert "staleness/start_lag_max" not in staleness_metrics(batch_of(3).groups, version=4)


def test_the_token_bound_masks_the_old_tokens_keeps_the_sample_and_counts_what_it_masked():
    batch = long_and_short_batch()
    bounded, metrics = mask_stale_tokens(batch, version=9, max_token_staleness=3)  # keeps versions >= 6
    long, short = (group.trajectories[0] for group in bounded.groups)
    assert long.loss_mask == [0, 0, 0, 1, 1, 1] and long.behaviour_logprobs == [0.0] * 3 + [-0.5] * 3
    assert long.completion_ids == batch.groups[0].trajectories[0].completion_ids, "the sample is kept whole"
    assert short.loss_mask == [1, 0, 1], "fresh tokens and the environment token untouched"
    assert metrics == {"staleness/masked_token_frac": 3 / 8}
    assert staleness_metrics(bounded.groups, version=9)["staleness/token_max"] == 3.0, "no trained token past the bound"
    assert staleness_metrics(bounded.groups, version=9)["staleness/start_lag_max"] == 1.0, "the start is still the start"
    assert batch.groups[0].trajectories[0].loss_mask == [1] * 6, "the batch handed in is not changed"


@pytest.mark.parametrize("bound", [TOKEN_BOUND_OFF, 5])
def test_an_off_or_loose_token_bound_masks_nothing(bound):
    batch = long_and_short_batch()
    bounded, metrics = mask_stale_tokens(batch, version=9, max_token_staleness=bound)
    assert [t.loss_mask for g in bounded.groups for t in g.trajectories] == [[1] * 6, [1, 0, 1]]
    assert metrics == {"staleness/masked_token_frac": 0.0}


def test_tokens_without_a_version_are_never_masked():
    unversioned = sample([-1, 2])
    batch = Batch(groups=[TrajectoryGroup("u", "g", "s", [unversioned])], offsets=[0], next_offset=1)
    bounded, metrics = mask_stale_tokens(batch, version=9, max_token_staleness=0)
    assert bounded.groups[0].trajectories[0].loss_mask == [1, 0] and metrics["staleness/masked_token_frac"] == 0.5
