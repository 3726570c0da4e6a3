"""The safety guard: watches named metrics against their recent best and, when one collapses, rolls the
learner back to a checkpoint taken before it, then goes on.

A rollback after step T restores what a resume restores from that checkpoint (weights, optimizer, RNG, task
weights) and optionally scales the learning rate down. The buffer position is not moved back: the samples
trained since the checkpoint are discarded (they came from the policy that collapsed), never trained again.
So are the ones the collapsed policy was already admitted to sample: the learner consumes and discards the
next K + 1 batches at version T (K = `buffer.max_staleness`, or with auto the K of step T's batch), as many as
admission lets the servers hold in the buffer and in flight, while admission stays paused (the version does not move while they are drained). The
restored weights then go to the servers as version T + K + 1: every version still counts the batches
consumed (which admission's bound relies on), and any sample of the collapsed policy left is too stale to be
trained. Both kinds count in `guard/discarded_samples`. The checkpoints newer than the one restored (the
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
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from asyncrl.config.guard import GuardConfig, WatchedMetricConfig
from asyncrl.staleness import trainable
from learner.checkpoint import META_FILE, checkpoint_at_or_before, load_checkpoint, remove_checkpoints_after
from asyncrl.messages import Batch
from learner.distributed import World, broadcast_bytes

if TYPE_CHECKING:
    from learner.loop import LoopState

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


@dataclass
class RollbackHooks:
    fetch_batch: Callable[[int, int], Batch] | None  # rank 0: the next batch for a version under a K (None on the other ranks)
    resume: Callable[["LoopState"], None]  # every rank: share the restored weights (and task weights) as the new version


class SafetyGuard:
    """Every rank holds one; rank 0 observes the metrics and decides, the others follow its decision."""

    def __init__(self, settings: GuardConfig, max_staleness: int, checkpoints: Path, reach: int,
                 saved: Mapping[str, Any]) -> None:
        """`reach`: how many steps the kept checkpoints span (checkpoint_every × keep_checkpoints); `saved`: the
        guard's state in the checkpoint resumed from ({} for a fresh run)."""
        self.settings, self.max_staleness, self.checkpoints, self.reach = settings, max_staleness, checkpoints, reach
        self.detector = CollapseDetector(settings, reach, saved.get("history"))
        self.rollbacks: int = saved.get("rollbacks", 0)
        self.discarded_samples: int = saved.get("discarded_samples", 0)
        self.drained_groups: int = saved.get("drained_groups", 0)  # groups consumed by drains (stale drops included)
        # (step, samples trained) since the oldest checkpoint a rollback may reach back to
        self.trained: list[tuple[int, int]] = [(int(step), int(n)) for step, n in saved.get("trained", [])]
        self.pending: Collapse | None = None

    def observe(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Rank 0, before step `step`'s record is logged: look for a collapse; returns the `guard/*` metrics."""
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

    def agreed_collapse(self, world: World) -> Collapse | None:
        """Every rank, after the step: rank 0's finding, on every rank."""
        found, self.pending = self.pending, None
        if world.size == 1:
            return found
        payload = broadcast_bytes(json.dumps(dataclasses.asdict(found) if found else None).encode(), world)
        decided = json.loads(payload)
        return Collapse(**decided) if decided else None

    def roll_back(self, collapse: Collapse, state: LoopState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  world: World, hooks: RollbackHooks) -> None:
        """Every rank: restore the checkpoint `collapse` names; `state` (updated in place) is where training goes on."""
        if self.rollbacks >= self.settings.max_rollbacks:
            raise GuardStopped(f"{collapse.describe()}; {self.rollbacks} rollbacks done (guard.max_rollbacks): stopping the run")
        if not collapse.checkpoint:
            raise GuardStopped(f"{collapse.describe()}; no checkpoint {self.settings.rollback_steps} or more steps before "
                               "it (guard.rollback_steps) to roll back to: stopping the run")
        version = first_untrainable_version(collapse.step, collapse.max_staleness)
        drained = self._drain(collapse.step, version - collapse.step, collapse.max_staleness, state, hooks.fetch_batch)
        meta = load_checkpoint(Path(collapse.checkpoint), model, optimizer, world)
        if world.is_main:  # the newer ones hold the branch rolled back: never resumed from, nor rolled back to
            remove_checkpoints_after(self.checkpoints, meta["step"])
        trained = sum(samples for step, samples in self.trained if meta["step"] < step <= collapse.step)
        self.rollbacks += 1
        self.discarded_samples += trained + drained
        self.detector.forget_after(meta["step"])
        self.trained = [(step, samples) for step, samples in self.trained if step <= meta["step"]]
        # in place: rank 0's step callback keeps the task weights in this same state object
        state.step, state.bad_steps, state.task_weights = version, 0, meta.get("task_weights", {})
        state.lr_scale *= self.settings.lr_scale
        log.error("GUARD: rolled back to %s (step %d) as version %d: discarded the %d samples trained since and the %d "
                  "sampled for later steps; learning rate × %g; rollback %d of at most %d", collapse.checkpoint,
                  meta["step"], version, trained, drained, state.lr_scale, self.rollbacks, self.settings.max_rollbacks)
        hooks.resume(state)

    def _drain(self, version: int, batches: int, max_staleness: int, state: LoopState,
               fetch_batch: Callable[[int, int], Batch] | None) -> int:
        """Rank 0: consume and discard `batches` batches at `version` (what the collapsed policy was admitted to
        sample), moving the loop's buffer position past them; returns their samples."""
        if fetch_batch is None:
            return 0
        samples = 0
        for _ in range(batches):
            batch = fetch_batch(version, max_staleness)
            samples += sum(len(group.trajectories) for group in batch.groups)
            self.drained_groups += len(batch.groups) + batch.dropped_stale
            state.buffer_offset, state.buffer_ahead = batch.next_offset, batch.next_ahead
        return samples

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run counts its rollbacks and compares with the same bests."""
        return {"rollbacks": self.rollbacks, "discarded_samples": self.discarded_samples, "drained_groups": self.drained_groups,
                "history": {name: [list(entry) for entry in values] for name, values in self.detector.history.items()},
                "trained": [list(entry) for entry in self.trained]}


def first_untrainable_version(step: int, max_staleness: int) -> int:
    """The first version after `step` at which no sample drawn by a policy of version `step` or older can be trained:
    the version of the restored weights (the batches up to it are drained)."""
    version = step + 1
    while trainable(version, step, max_staleness):
        version += 1
    return version
