"""The learner's `staleness/*` of a batch: learner version − each group's oldest token version."""

from __future__ import annotations

from asyncrl.messages import Batch
from demo.synthetic import synthetic_group
from learner.staleness import staleness_metrics


def batch_of(*versions: int) -> Batch:
    groups = [synthetic_group(f"r{i}", completion_tokens=2, version=v) for i, v in enumerate(versions)]
    return Batch(groups=groups, offsets=list(range(len(groups))), next_offset=len(groups))


def test_mean_min_and_max_over_the_groups():
    assert staleness_metrics(batch_of(7, 5, 4), version=8) == {"staleness/mean": 8 / 3, "staleness/min": 1.0,
                                                                 "staleness/max": 4.0}


def test_a_batch_trained_exactly_k_versions_old_has_min_equal_to_max():
    metrics = staleness_metrics(batch_of(6, 6, 6), version=10)
    assert metrics["staleness/min"] == metrics["staleness/max"] == metrics["staleness/mean"] == 4.0
