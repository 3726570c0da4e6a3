"""The learner's main loop, the same on every rank: take rank 0's batch, train on it, log the step, apply the
safety guard's decision, checkpoint when due. What only rank 0 does (the buffer, the rollout servers, the
metrics, the guard's judgement) sits behind `RankServices` (learner/services/rank_services.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from asyncrl.config import AsyncRLConfig
from asyncrl.config.learner import LearnerConfig
from learner.bad_steps import note_bad_step
from learner.loop_state import LoopState
from learner.maths.lr_schedule import learning_rate
from learner.maths.staleness import mask_stale_tokens
from learner.maths.step_metrics import StepTimes, step_metrics
from learner.policy.checkpoint import CHECKPOINTS_DIR
from learner.policy.policy_trainer import PolicyTrainer
from learner.services.guard import GuardDecision, GuardStopped, RollBack, Stop
from learner.services.rank_services import RankServices

log = logging.getLogger(__name__)


def run_loop(config: AsyncRLConfig, run_dir: Path, state: LoopState, trainer: PolicyTrainer,
             services: RankServices) -> LoopState:
    """Train from `state` (updated in place) until learner.total_steps."""
    settings = config.learner
    state.max_staleness = services.max_staleness  # rank 0's pacer keeps a resumed K inside its bounds
    services.begin(state.step)
    while state.step < settings.total_steps:
        started = time.perf_counter()
        batch = services.next_batch(state.step, state.max_staleness)
        waited = time.perf_counter() - started
        batch, masked = mask_stale_tokens(batch, state.step, config.algorithm.max_token_staleness)
        rate = learning_rate(state.step, settings) * state.lr_scale
        outcome = trainer.train(batch.groups, rate)
        trained = time.perf_counter() - started - waited
        if not outcome.finite:  # skipped: weights, optimizer, version and buffer position stay
            state.bad_steps += 1
            note_bad_step(state.bad_steps, state.step + 1, settings.max_bad_steps)
            continue
        state.trained(batch)
        metrics = masked | step_metrics(outcome.metrics, batch, state.step, rate, state.max_staleness,
                                        StepTimes(started, waited, trained))
        state.max_staleness = services.pace(state.step, metrics)
        services.after_step(state.step, metrics)
        rolled_back = apply_guard(services.guard_decision(), state, trainer, services)
        if rolled_back or checkpoint_due(state.step, settings):  # after a rollback: a crash now resumes from it
            save_checkpoint(run_dir, state, trainer, services)
    return state


def apply_guard(decision: GuardDecision, state: LoopState, trainer: PolicyTrainer, services: RankServices) -> bool:
    """Carry out the guard's decision after a step; returns whether it rolled back."""
    if isinstance(decision, Stop):
        raise GuardStopped(decision.reason)
    if isinstance(decision, RollBack):
        roll_back(decision, state, trainer, services)
        return True
    return False


def roll_back(rollback: RollBack, state: LoopState, trainer: PolicyTrainer, services: RankServices) -> None:
    """Restore the checkpoint `rollback` names and go on as its version (learner/services/guard.py says why those)."""
    drained = services.drain(rollback, state.buffer_offset, state.buffer_ahead)
    state.buffer_offset, state.buffer_ahead = drained.next_offset, drained.next_ahead
    restored = trainer.restore(Path(rollback.checkpoint))
    trained = services.rolled_back(rollback, drained)
    state.step, state.bad_steps, state.task_weights = rollback.version, 0, restored.get("task_weights", {})
    state.lr_scale *= rollback.lr_scale
    log.error("GUARD: rolled back to %s (step %d) as version %d: discarded the %d samples trained since and the %d "
              "sampled for later steps; learning rate × %g; rollback %d of at most %d", rollback.checkpoint,
              restored["step"], rollback.version, trained, drained.samples, state.lr_scale, rollback.rollback,
              rollback.max_rollbacks)
    services.resume(state.step, state.task_weights)


def checkpoint_due(step: int, settings: LearnerConfig) -> bool:
    return step % settings.checkpoint_every == 0 or step == settings.total_steps


def save_checkpoint(run_dir: Path, state: LoopState, trainer: PolicyTrainer, services: RankServices) -> None:
    """Save the checkpoint of `state.step`, then commit the buffer position it holds."""
    trainer.save(run_dir / CHECKPOINTS_DIR, state.step, state.checkpoint_meta() | services.checkpoint_meta())
    services.committed(state.step, state.buffer_offset, state.buffer_ahead)
