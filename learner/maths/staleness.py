"""The learner's side of the staleness rule (`asyncrl/staleness.py`): what a batch measures, and the optional
per-token bound that masks tokens instead of dropping samples.

A group's staleness is the learner version that trains it minus the version it started under (its oldest
trained token); token staleness is the same per trained token, so a long response that ran through many updates
weighs as much as its tokens do. The start lag, the learner's version when the group started minus the version
it started from, is what K bounds."""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncrl.messages import Batch, Trajectory, TrajectoryGroup
from asyncrl.staleness import oldest_trained_token_version, staleness


def staleness_metrics(groups: list[TrajectoryGroup], version: int) -> dict[str, float]:
    """`staleness/*` of the batch's groups trained at `version`: over the groups, over their trained tokens, and the
    largest start lag; each left out when nothing in the batch has it (no trained token, no known start)."""
    return _group_staleness(groups, version) | _token_staleness(groups, version) | _start_lag(groups)


def mask_stale_tokens(batch: Batch, version: int, max_token_staleness: int) -> tuple[Batch, dict[str, float]]:
    """The batch a step at `version` trains under the per-token bound M: every trained token sampled more than M
    versions before it gets loss mask 0 (and behaviour log-prob 0, as every untrained token), the sample and its
    other tokens kept; and `staleness/masked_token_frac`, the share of the batch's trained tokens masked so."""
    oldest = oldest_trained_token_version(version, max_token_staleness)
    trained = sum(sum(t.loss_mask) for group in batch.groups for t in group.trajectories)
    if oldest is None or not trained:
        return batch, {"staleness/masked_token_frac": 0.0}
    masked_groups, masked = [], 0
    for group in batch.groups:
        bounded = [_mask_older_than(trajectory, oldest) for trajectory in group.trajectories]
        masked += sum(count for _, count in bounded)
        masked_groups.append(dataclasses.replace(group, trajectories=[trajectory for trajectory, _ in bounded]))
    return dataclasses.replace(batch, groups=masked_groups), {"staleness/masked_token_frac": masked / trained}


def _mask_older_than(trajectory: Trajectory, oldest: int) -> tuple[Trajectory, int]:
    """The trajectory with its trained tokens of versions below `oldest` masked out; how many there were. Tokens
    without a version (-1) are never judged stale."""
    versions, mask = np.asarray(trajectory.token_versions), np.asarray(trajectory.loss_mask, dtype=bool)  # [T], [T]
    stale = mask & (versions >= 0) & (versions < oldest)  # [T]
    if not stale.any():
        return trajectory, 0
    logprobs = np.where(stale, 0.0, np.asarray(trajectory.behaviour_logprobs, dtype=np.float32))  # [T]
    kept = dataclasses.replace(trajectory, loss_mask=(mask & ~stale).astype(int).tolist(), behaviour_logprobs=logprobs.tolist())
    return kept, int(stale.sum())


def _group_staleness(groups: list[TrajectoryGroup], version: int) -> dict[str, float]:
    """Mean, min and max over the groups; groups with no trained token (oldest version -1) are left out."""
    oldest = [group.oldest_version() for group in groups]
    values = [staleness(version, group_oldest) for group_oldest in oldest if group_oldest >= 0]
    if not values:
        return {}
    return {"staleness/mean": sum(values) / len(values), "staleness/min": float(min(values)),
            "staleness/max": float(max(values))}


def _token_staleness(groups: list[TrajectoryGroup], version: int) -> dict[str, float]:
    """Mean and max over the batch's trained tokens (loss mask 1, versioned)."""
    lags = np.concatenate([np.empty(0, np.int64), *(_trained_token_lags(t, version) for group in groups
                                                   for t in group.trajectories)])  # [trained tokens of the batch]
    if not lags.size:
        return {}
    return {"staleness/token_mean": float(lags.mean()), "staleness/token_max": float(lags.max())}


def _trained_token_lags(trajectory: Trajectory, version: int) -> np.ndarray:
    versions, mask = np.asarray(trajectory.token_versions, dtype=np.int64), np.asarray(trajectory.loss_mask, dtype=bool)
    return version - versions[mask & (versions >= 0)]  # [trained tokens]


def _start_lag(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """The largest learner version at a group's start minus the version it started from (its first token's,
    whatever the loss mask says of it) over the groups whose start the server recorded."""
    lags = [staleness(group.learner_version_at_start, start) for group in groups
            if group.learner_version_at_start >= 0 and (start := group.start_version()) >= 0]
    return {"staleness/start_lag_max": float(max(lags))} if lags else {}
