"""The learner's main loop on every rank: take a batch, train, sync weights, publish the version,
checkpoint, log. Rank 0 talks to the buffer and the rollout servers; the other ranks follow it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from asyncrl.config import AsyncRLConfig
from asyncrl.messages import Batch, TrajectoryGroup, decode, encode
from learner.pacing import Pacer
from asyncrl.task_metrics import ScoredSample, task_reward_metrics, task_sample_counts
from learner.bad_steps import note_bad_step
from learner.batching import collate
from learner.checkpoint import CHECKPOINTS_DIR, latest_checkpoint, load_checkpoint, save_checkpoint
from learner.distributed import World, broadcast_bytes
from learner.guard import RollbackHooks, SafetyGuard
from learner.lr_schedule import learning_rate, set_learning_rate
from learner.staleness import staleness_metrics
from learner.train_step import Passes, train_step

log = logging.getLogger(__name__)


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done = policy version
    buffer_offset: int = -1  # buffer log position after the last trained batch (-1 = the buffer's commit)
    buffer_ahead: list[int] = field(default_factory=list)  # records at or past buffer_offset trained (or dropped) too
    bad_steps: int = 0  # consecutive skipped steps
    task_weights: dict[str, Any] = field(default_factory=dict)  # rank 0's task-weight scheduler state ({} when off)
    lr_scale: float = 1.0  # factor on the scheduled learning rate (guard.lr_scale at each rollback)
    guard: dict[str, Any] = field(default_factory=dict)  # the safety guard's state in the checkpoint resumed from
    max_staleness: int = 0  # K rank 0 takes the next batch under (changes during the run with buffer.max_staleness=auto)
    timings: dict[str, float] = field(default_factory=dict)


def resume_state(config: AsyncRLConfig, run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 world: World) -> LoopState:
    """Where training continues: a checkpoint named by learner.resume, the latest one (auto), or scratch."""
    choice, starting_k = config.learner.resume, config.buffer.starting_staleness()
    if choice == "never":
        return LoopState(max_staleness=starting_k)
    path = latest_checkpoint(run_dir / CHECKPOINTS_DIR) if choice == "auto" else Path(choice)
    if path is None:
        return LoopState(max_staleness=starting_k)
    meta = load_checkpoint(path, model, optimizer, world)
    paced_k = meta.get("max_staleness", starting_k) if config.buffer.paced else starting_k  # a fixed K is the config's
    return LoopState(step=meta["step"], buffer_offset=meta["buffer_offset"], buffer_ahead=meta.get("buffer_ahead", []),
                     task_weights=meta.get("task_weights", {}), lr_scale=meta.get("lr_scale", 1.0), guard=meta.get("guard", {}),
                     max_staleness=paced_k)


def run_loop(
    config: AsyncRLConfig,
    run_dir: Path,
    world: World,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: LoopState,
    fetch_batch: Callable[[int, int], Batch] | None,
    after_step: Callable[[int, dict[str, float]], None],
    after_checkpoint: Callable[[int, int, list[int]], None],
    pad_id: int,
    passes: Passes,
    reference: torch.nn.Module | None = None,
    guard: SafetyGuard | None = None,
    rollback_hooks: RollbackHooks | None = None,
) -> LoopState:
    """Train until learner.total_steps. `fetch_batch(version, max_staleness)` (rank 0 only) returns the next batch;
    `after_step(version, metrics)` syncs weights, publishes the version and logs;
    `after_checkpoint(version, buffer_offset, buffer_ahead)` commits the position once the checkpoint holds it;
    `passes` says how each batch goes through the model; `reference` is the frozen model of algorithm.use_reference;
    `guard` rolls back after a collapse its rank 0 saw in `after_step` (`rollback_hooks` pause and resume the servers)."""
    settings = config.learner
    paced = config.buffer.paced and world.is_main  # rank 0 takes the batches: its K is the one that counts
    pacer = Pacer(config.buffer.pacing, state.max_staleness, config.rollout.sampling.n) if paced else None
    if pacer is not None:
        state.max_staleness = pacer.k
    while state.step < settings.total_steps:
        started = time.perf_counter()
        batch = _shared_batch(fetch_batch(state.step, state.max_staleness) if world.is_main else None, world)
        waited = time.perf_counter() - started
        rate = learning_rate(state.step, settings) * state.lr_scale
        set_learning_rate(optimizer, rate)
        outcome = train_step(
            model, optimizer, collate(canonical_order(batch.groups), pad_id), config.algorithm, passes, settings.grad_clip, world,
            reference,
        )
        trained = time.perf_counter() - started - waited
        if not outcome.finite:
            state.bad_steps += 1
            note_bad_step(state.bad_steps, state.step + 1, settings.max_bad_steps)
            continue
        state.bad_steps = 0
        state.step += 1
        state.buffer_offset, state.buffer_ahead = batch.next_offset, batch.next_ahead
        metrics = outcome.metrics | staleness_metrics(batch, state.step - 1) | _batch_metrics(batch) | {"actor/lr": rate}
        metrics |= {"timing_s/wait_batch": waited, "timing_s/train": trained, "timing_s/step": time.perf_counter() - started,
                    "learner/tokens_per_s": _trained_tokens(batch) / trained, "staleness/max_staleness": state.max_staleness}
        if pacer is not None:
            state.max_staleness = pacer.observe(state.step, metrics).k
        after_step(state.step, metrics)
        if guard is not None and (collapse := guard.agreed_collapse(world)) is not None:
            assert rollback_hooks is not None
            guard.roll_back(collapse, state, model, optimizer, world, rollback_hooks)
            _checkpoint(run_dir, state, model, optimizer, world, settings.keep_checkpoints, guard, after_checkpoint)  # a crash now resumes here
            continue
        if state.step % settings.checkpoint_every == 0 or state.step == settings.total_steps:
            _checkpoint(run_dir, state, model, optimizer, world, settings.keep_checkpoints, guard, after_checkpoint)
    return state


def _checkpoint(run_dir: Path, state: LoopState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                keep: int, guard: SafetyGuard | None, after_checkpoint: Callable[[int, int, list[int]], None]) -> None:
    meta = {"buffer_offset": state.buffer_offset, "buffer_ahead": state.buffer_ahead, "task_weights": state.task_weights,
            "lr_scale": state.lr_scale, "guard": guard.state_dict() if guard is not None else {},
            "max_staleness": state.max_staleness}
    save_checkpoint(run_dir / CHECKPOINTS_DIR, state.step, model, optimizer, meta, world, keep)
    after_checkpoint(state.step, state.buffer_offset, state.buffer_ahead)


def canonical_order(groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """The batch's groups sorted by content, not by arrival: the same samples give the same micro-batches
    and float sums whatever order concurrent requests finished in (K=0 then reproduces sync mode)."""
    return sorted(groups, key=lambda group: [(t.prompt_ids, t.completion_ids) for t in group.trajectories])


def _shared_batch(batch: Batch | None, world: World) -> Batch:
    """Rank 0's batch on every rank, as msgpack bytes."""
    if world.size == 1:
        assert batch is not None
        return batch
    return decode(broadcast_bytes(encode(batch) if batch is not None else None, world), max_bytes=2**62, expect=Batch)


def _trained_tokens(batch: Batch) -> int:
    """Completion tokens the loss covers (loss-mask ones), comparable to the servers' generated tokens."""
    return sum(sum(t.loss_mask) for group in batch.groups for t in group.trajectories)


def _batch_metrics(batch: Batch) -> dict[str, Any]:
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
