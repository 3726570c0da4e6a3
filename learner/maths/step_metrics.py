"""The record of one learner step as the loop measures it: the loss's numbers, the batch's rewards, lengths and
staleness, where in the buffer it came from, the learning rate and the step's timings (docs/metrics.md). The
synchronous reference (`launch/reference_loop.py`) measures its batches with the same `batch_metrics`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from asyncrl.messages import Batch, TrajectoryGroup
from asyncrl.task_metrics import ScoredSample, task_reward_metrics, task_sample_counts
from learner.maths.staleness import staleness_metrics


@dataclass(frozen=True)
class StepTimes:
    started: float  # time.perf_counter() when the step began
    waited: float  # seconds waiting for the batch
    trained: float  # seconds training on it


def step_metrics(loss_metrics: dict[str, float], batch: Batch, version: int, rate: float, max_staleness: int,
                 times: StepTimes) -> dict[str, Any]:
    """The record of the step that made `version` from `batch` at learning rate `rate` under the bound `max_staleness`."""
    metrics = loss_metrics | batch_metrics(batch.groups, version - 1) | buffer_metrics(batch) | {"actor/lr": rate}
    return metrics | {"timing_s/wait_batch": times.waited, "timing_s/train": times.trained,
                      "timing_s/step": time.perf_counter() - times.started,
                      "learner/tokens_per_s": metrics["batch/tokens"] / times.trained, "staleness/max_staleness": max_staleness}


def batch_metrics(groups: list[TrajectoryGroup], version: int) -> dict[str, Any]:
    """Rewards (per task too), lengths, turns, failures and staleness of the groups trained at policy `version`.
    `batch/tokens` counts the completion tokens the loss covers (loss mask 1), comparable to the servers' generated
    tokens. The synchronous reference logs the same; its staleness is 0 by construction, and measured all the
    same: it is what the async job is compared on."""
    samples = [t for group in groups for t in group.trajectories]
    lengths = [sum(t.loss_mask) for t in samples]
    rewards = [t.reward for t in samples]
    return staleness_metrics(groups, version) | {
        "critic/score/mean": sum(rewards) / len(rewards),
        "response_length/mean": sum(lengths) / len(lengths),
        "batch/samples": float(len(samples)),
        "batch/tokens": float(sum(lengths)),
        "reward/failures": float(sum(1 for t in samples if t.reward_error)),
        "multi_turn/num_turns/mean": sum(t.num_turns for t in samples) / len(samples),
    } | task_reward_metrics((ScoredSample(t.data_source, t.reward, t.reward_info) for t in samples), "critic") | \
        task_sample_counts(t.data_source for t in samples)


def buffer_metrics(batch: Batch) -> dict[str, float]:
    """Where in the buffer's log the batch came from, and what was dropped while it was gathered."""
    return {
        "buffer/dropped_stale_in_batch": float(batch.dropped_stale),
        "batch/offset_min": float(min(batch.offsets)),
        "batch/offset_max": float(max(batch.offsets)),
    }
