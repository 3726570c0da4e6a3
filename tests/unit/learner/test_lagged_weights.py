"""`LaggedWeights` (buffer.study_lag_versions): which version's weights the servers get at each broadcast."""

from __future__ import annotations

import pytest
import torch

from learner.services.lagged_weights import LaggedWeights


def weights_of(version: int) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((2,), float(version)))]


def sent(lagged: LaggedWeights, version: int) -> tuple[int, float]:
    """The version sent at `version` and the value its weights hold (equal when the right copy went out)."""
    chosen, weights = lagged.lagged(version, weights_of(version))
    return chosen, weights[0][1][0].item()


def test_each_broadcast_sends_the_weights_of_lag_versions_back_once_there_are_that_many():
    lagged = LaggedWeights(3)
    # versions 0..2: only version 0 is old enough to lead (the warm-up); from version 3 on exactly 3 back
    assert [sent(lagged, v) for v in range(8)] == [(0, 0.0), (0, 0.0), (0, 0.0), (0, 0.0), (1, 1.0), (2, 2.0),
                                                   (3, 3.0), (4, 4.0)]


def test_after_a_resume_the_lag_builds_up_again_from_the_resumed_version():
    lagged = LaggedWeights(2)
    assert [sent(lagged, v)[0] for v in range(10, 15)] == [10, 10, 10, 11, 12]


def test_a_version_never_given_is_skipped_not_invented():
    lagged = LaggedWeights(2)
    assert [sent(lagged, v)[0] for v in (0, 1, 4, 5, 6)] == [0, 0, 4, 4, 4]  # 2 and 3 were never given


def test_a_lag_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        LaggedWeights(0)
