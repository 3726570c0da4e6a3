"""The safety guard: watches named metrics against their recent best and, when one collapses, decides that the
learner rolls back to a checkpoint taken before it and goes on, or that the run stops. The guard decides; the
loop applies the decision (learner/loop.py), on every rank.

A rollback after step T restores what a resume restores from that checkpoint (weights, optimizer, RNG, task
weights) and optionally scales the learning rate down. The buffer position is not moved back: the samples
trained since the checkpoint are discarded (they came from the policy that collapsed), never trained again.
So are the ones the collapsed policy was already admitted to sample: the learner consumes and discards the
next K + 1 batches at version T (K = `buffer.max_staleness`, or with auto the K of step T's batch), as many as
admission lets the servers hold in the buffer and in flight, while admission stays paused (the version does not
move while they are drained): they are every group the collapsed policy started, long ones included (the drain
waits for them). The restored weights then go to the servers as version T + K + 1: every version still counts
the batches consumed, which admission's bound relies on. Both kinds count in `guard/discarded_samples`. The checkpoints newer than the one restored (the
rolled-back branch) are deleted, and the restored state is saved at once as a checkpoint of the new version.
After `guard.max_rollbacks` rollbacks the next collapse stops the run with its reason.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from asyncrl.config import AsyncRLConfig
from asyncrl.config.guard import GuardConfig, WatchedMetricConfig
from asyncrl.staleness import drained_version
from learner.distributed import World, broadcast_bytes
from learner.policy.checkpoint import META_FILE, checkpoint_at_or_before, remove_checkpoints_after

log = logging.getLogger(__name__)

SAMPLES_KEY = "batch/samples"
BOUND_KEY = "staleness/max_staleness"  # K of the step's batch: what admission let the collapsed policy sample under


class GuardStopped(RuntimeError):
    """A watched metric collapsed and no rollback is left (guard.max_rollbacks) or possible (no checkpoint)."""


@dataclass(frozen=True)
class Collapse:
    step: int  # the learner step whose metrics showed it
    metric: str  # the watched metric
    value: float  # its value then
    best: float  # its recent best
    drop: float  # relative worsening against the best (inf for a value that is not finite)
    checkpoint: str = ""  # the checkpoint to roll back to ("" when none is old enough)
    checkpoint_step: int = -1  # its step
    max_staleness: int = 0  # K the step's batch was taken under (rank 0's: with buffer.max_staleness=auto it changes)

    def describe(self) -> str:
        return (f"{self.metric} = {self.value:.4g} at step {self.step}, {self.drop:.0%} worse than its recent best "
                f"{self.best:.4g}")


def relative_drop(watched: WatchedMetricConfig, best: float, value: float) -> float:
    """How much worse `value` is than `best`, relative to |best| (0 when it is not worse or best is 0)."""
    if not math.isfinite(value):
        return math.inf
    worse = best - value if watched.higher_is_better else value - best
    return worse / abs(best) if worse > 0 and best != 0 else 0.0


class CollapseDetector:
    """Rank 0's record of the watched metrics: (step, value) of each, as logged."""

    def __init__(self, settings: GuardConfig, reach: int, history: Mapping[str, list[list[float]]] | None = None) -> None:
        """`reach`: how many steps a rollback may go back; the values of that many steps more than the window are
        kept, so that after a rollback the window holds the values measured up to the restored checkpoint."""
        self.settings, self.kept = settings, settings.window + reach
        self.history: dict[str, list[tuple[int, float]]] = {
            watched.name: [(int(step), value) for step, value in (history or {}).get(watched.name, [])]
            for watched in settings.watch}

    def observe(self, step: int, metrics: Mapping[str, float]) -> Collapse | None:
        """Compare step `step`'s values with each metric's recent best; the first collapse found, if any."""
        found = None
        for watched in self.settings.watch:
            value = metrics.get(watched.name)
            if value is None:
                continue
            recent = [earlier for _, earlier in self.history[watched.name][-self.settings.window:]]
            if recent and found is None:
                best = max(recent) if watched.higher_is_better else min(recent)
                drop = relative_drop(watched, best, value)
                if drop > watched.max_drop:
                    found = Collapse(step, watched.name, value, best, drop)
            if math.isfinite(value):
                self.history[watched.name].append((step, value))
                del self.history[watched.name][:-self.kept]
        return found

    def forget_after(self, step: int) -> None:
        """Drop the values logged after `step` (they measured the policy rolled back)."""
        self.history = {name: [(s, v) for s, v in values if s <= step] for name, values in self.history.items()}


@dataclass(frozen=True)
class GoOn:
    """No collapse: training goes on."""


@dataclass(frozen=True)
class RollBack:
    """Restore `checkpoint` and go on as `version`, after draining what the collapsed policy was admitted to sample."""

    reason: str  # the collapse, described
    checkpoint: str  # the checkpoint to restore
    checkpoint_step: int  # its step
    collapsed_step: int  # the step whose metrics collapsed: the drained batches are asked for at this version
    max_staleness: int  # K they are asked under: the collapsed step's (admission let the policy sample under it)
    version: int  # the version of the restored weights: past the drain of every group the collapsed policy started
    lr_scale: float  # factor on the learning rate from now on (guard.lr_scale)
    rollback: int  # this rollback's number, 1 for the first
    max_rollbacks: int  # guard.max_rollbacks

    @property
    def drained_batches(self) -> int:
        """Batches the servers may already hold or sample for the collapsed policy: K + 1 with a fixed K."""
        return self.version - self.collapsed_step


@dataclass(frozen=True)
class Stop:
    """A collapse with no rollback left (guard.max_rollbacks) or possible (no checkpoint old enough)."""

    reason: str  # the collapse and why no rollback answers it


GuardDecision = GoOn | RollBack | Stop
GO_ON = GoOn()
_DECISIONS = {kind.__name__: kind for kind in (GoOn, RollBack, Stop)}


def share_decision(decision: GuardDecision | None, world: World) -> GuardDecision:
    """Rank 0's decision (`decision`; None on the other ranks) on every rank, as JSON."""
    if world.size == 1:
        assert decision is not None
        return decision
    received = json.loads(broadcast_bytes(_as_json(decision) if decision is not None else None, world))
    return _DECISIONS[received.pop("kind")](**received)


def _as_json(decision: GuardDecision) -> bytes:
    return json.dumps({"kind": type(decision).__name__, **dataclasses.asdict(decision)}).encode()


@dataclass(frozen=True)
class Drained:
    """What a rollback consumed and discarded from the buffer, and the position past it."""

    samples: int  # samples in the drained batches
    groups: int  # groups consumed, those dropped for a start outside the bound included
    next_offset: int  # the buffer position after the drained batches
    next_ahead: list[int]  # records at or past next_offset consumed too


class SafetyGuard:
    """Rank 0's guard: observes each step's metrics, decides after the step, and keeps count of its rollbacks."""

    def __init__(self, settings: GuardConfig, max_staleness: int, checkpoints: Path, reach: int,
                 saved: Mapping[str, Any]) -> None:
        """`reach`: how many steps the kept checkpoints span (checkpoint_every × keep_checkpoints); `saved`: the
        guard's state in the checkpoint resumed from ({} for a fresh run)."""
        self.settings, self.max_staleness, self.checkpoints, self.reach = settings, max_staleness, checkpoints, reach
        self.detector = CollapseDetector(settings, reach, saved.get("history"))
        self.rollbacks: int = saved.get("rollbacks", 0)
        self.discarded_samples: int = saved.get("discarded_samples", 0)
        self.drained_groups: int = saved.get("drained_groups", 0)  # groups consumed by drains (drops included)
        # (step, samples trained) since the oldest checkpoint a rollback may reach back to
        self.trained: list[tuple[int, int]] = [(int(step), int(n)) for step, n in saved.get("trained", [])]
        self.pending: Collapse | None = None

    @classmethod
    def of_run(cls, config: AsyncRLConfig, checkpoints: Path, saved: Mapping[str, Any]) -> SafetyGuard:
        """The guard of `guard.enabled` over the run's `checkpoints`, continuing from `saved`."""
        reach = config.learner.checkpoint_every * config.learner.keep_checkpoints
        return cls(config.guard, config.buffer.starting_staleness(), checkpoints, reach, saved)

    def observe(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Before step `step`'s record is logged: look for a collapse; returns the `guard/*` metrics."""
        self.trained = [(done, samples) for done, samples in self.trained if done > step - self.reach]
        self.trained.append((step, int(metrics.get(SAMPLES_KEY, 0))))
        collapse = self.detector.observe(step, metrics)
        logged = {"guard/rollbacks": float(self.rollbacks), "guard/discarded_samples": float(self.discarded_samples),
                  "guard/drained_groups": float(self.drained_groups), "guard/collapse": 0.0}
        if collapse is None:
            return logged
        target = checkpoint_at_or_before(self.checkpoints, step - self.settings.rollback_steps)
        target_step = int(json.loads((target / META_FILE).read_text())["step"]) if target is not None else -1
        self.pending = dataclasses.replace(collapse, checkpoint=str(target or ""), checkpoint_step=target_step,
                                           max_staleness=int(metrics.get(BOUND_KEY, self.max_staleness)))
        can_roll_back = target is not None and self.rollbacks < self.settings.max_rollbacks
        log.error("GUARD ALERT: %s; %s", collapse.describe(),
                  f"rolling back to checkpoint step {target_step}" if can_roll_back else "stopping the run")
        return logged | {"guard/collapse": 1.0, "guard/drop": collapse.drop, "guard/rollback_to": float(target_step)}

    def decide(self) -> GuardDecision:
        """After the step: go on, roll back to the checkpoint the collapse observed names, or stop the run."""
        collapse, self.pending = self.pending, None
        if collapse is None:
            return GO_ON
        if self.rollbacks >= self.settings.max_rollbacks:
            return Stop(f"{collapse.describe()}; {self.rollbacks} rollbacks done (guard.max_rollbacks): stopping the run")
        if not collapse.checkpoint:
            return Stop(f"{collapse.describe()}; no checkpoint {self.settings.rollback_steps} or more steps before it "
                        "(guard.rollback_steps) to roll back to: stopping the run")
        return RollBack(collapse.describe(), collapse.checkpoint, collapse.checkpoint_step, collapse.step,
                        collapse.max_staleness, drained_version(collapse.step, collapse.max_staleness),
                        self.settings.lr_scale, self.rollbacks + 1, self.settings.max_rollbacks)

    def agreed_decision(self, world: World) -> GuardDecision:
        """The decision after the step, on every rank (the others call `GuardFollower.agreed_decision`)."""
        return share_decision(self.decide(), world)

    def rolled_back(self, rollback: RollBack, drained: Drained) -> int:
        """Once the checkpoint is restored: delete the newer ones (the rolled-back branch: never resumed from, nor rolled
        back to), count what was discarded and forget the values measured since; returns the samples trained since
        the checkpoint."""
        restored = rollback.checkpoint_step
        remove_checkpoints_after(self.checkpoints, restored)
        trained = sum(samples for step, samples in self.trained if restored < step <= rollback.collapsed_step)
        self.rollbacks += 1
        self.discarded_samples += trained + drained.samples
        self.drained_groups += drained.groups
        self.detector.forget_after(restored)
        self.trained = [(step, samples) for step, samples in self.trained if step <= restored]
        return trained

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run counts its rollbacks and compares with the same bests."""
        return {"rollbacks": self.rollbacks, "discarded_samples": self.discarded_samples, "drained_groups": self.drained_groups,
                "history": {name: [list(entry) for entry in values] for name, values in self.detector.history.items()},
                "trained": [list(entry) for entry in self.trained]}


class GuardFollower:
    """The guard on the ranks other than 0: they take rank 0's decision."""

    def agreed_decision(self, world: World) -> GuardDecision:
        return share_decision(None, world)


class NoGuard:
    """`guard.enabled` false, on any rank: nothing watched, every step goes on, nothing exchanged between ranks."""

    def observe(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        return {}

    def agreed_decision(self, world: World) -> GuardDecision:
        return GO_ON

    def rolled_back(self, rollback: RollBack, drained: Drained) -> int:
        raise AssertionError("guard.enabled is false: no rollback was decided")

    def state_dict(self) -> dict[str, Any]:
        return {}

