"""The record of one learner step as the loop measures it: the loss's numbers, the batch's rewards, lengths and
staleness, the learning rate and the step's timings (docs/metrics.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from asyncrl.messages import Batch
from asyncrl.task_metrics import ScoredSample, task_reward_metrics, task_sample_counts
from learner.staleness import staleness_metrics


@dataclass(frozen=True)
class StepTimes:
    started: float  # time.perf_counter() when the step began
    waited: float  # seconds waiting for the batch
    trained: float  # seconds training on it


def step_metrics(loss_metrics: dict[str, float], batch: Batch, version: int, rate: float, max_staleness: int,
                 times: StepTimes) -> dict[str, Any]:
    """The record of the step that made `version` from `batch` at learning rate `rate` under the bound `max_staleness`."""
    metrics = loss_metrics | staleness_metrics(batch, version - 1) | batch_metrics(batch) | {"actor/lr": rate}
    return metrics | {"timing_s/wait_batch": times.waited, "timing_s/train": times.trained,
                      "timing_s/step": time.perf_counter() - times.started,
                      "learner/tokens_per_s": trained_tokens(batch) / times.trained, "staleness/max_staleness": max_staleness}


def trained_tokens(batch: Batch) -> int:
    """Completion tokens the loss covers (loss-mask ones), comparable to the servers' generated tokens."""
    return sum(sum(t.loss_mask) for group in batch.groups for t in group.trajectories)


def batch_metrics(batch: Batch) -> dict[str, Any]:
    samples = [t for group in batch.groups for t in group.trajectories]
    lengths = [sum(t.loss_mask) for t in samples]
    rewards = [t.reward for t in samples]
    return {
        "critic/score/mean": sum(rewards) / len(rewards),
        "response_length/mean": sum(lengths) / len(lengths),
        "buffer/dropped_stale_in_batch": float(batch.dropped_stale),
        "batch/samples": float(len(samples)),
        "reward/failures": float(sum(1 for t in samples if t.reward_error)),
        "multi_turn/num_turns/mean": sum(t.num_turns for t in samples) / len(samples),
        "batch/offset_min": float(min(batch.offsets)),
        "batch/offset_max": float(max(batch.offsets)),
    } | task_reward_metrics((ScoredSample(t.data_source, t.reward, t.reward_info) for t in samples), "critic") | \
        task_sample_counts(t.data_source for t in samples)
