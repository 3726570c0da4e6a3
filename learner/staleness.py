"""Staleness of a batch: learner version when it trains on a sample − the oldest version of its tokens."""

from __future__ import annotations

from asyncrl.messages import Batch
from asyncrl.staleness import staleness


def staleness_metrics(batch: Batch, version: int) -> dict[str, float]:
    """Mean, min and max over the batch's groups; groups with no trained token (oldest version -1) are left out."""
    oldest = [group.oldest_version() for group in batch.groups]
    values = [staleness(version, group_oldest) for group_oldest in oldest if group_oldest >= 0]
    if not values:
        return {}
    return {"staleness/mean": sum(values) / len(values), "staleness/min": float(min(values)),
            "staleness/max": float(max(values))}
