"""Staleness of a batch: learner version when it trains on a sample − the oldest version of its tokens."""

from __future__ import annotations

from asyncrl.messages import Batch


def staleness_metrics(batch: Batch, version: int) -> dict[str, float]:
    values = [version - group.oldest_version() for group in batch.groups if group.oldest_version() >= 0]
    if not values:
        return {}
    return {"staleness/mean": sum(values) / len(values), "staleness/max": float(max(values))}
