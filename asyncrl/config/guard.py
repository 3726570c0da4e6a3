"""`guard`: the safety guard that rolls the learner back when a watched metric collapses."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.config.fields import bounded


@dataclass
class WatchedMetricConfig:
    name: str = ""  # logged metric to watch, e.g. val/arithmetic/score/mean or critic/gsm8k/acc/mean
    higher_is_better: bool = True  # False for metrics that grow when training goes wrong (a KL, a loss)
    max_drop: float = bounded(0.3, 0.0)  # relative worsening against the recent best that counts as a collapse (0.3 = 30 %)


@dataclass
class GuardConfig:
    enabled: bool = False  # True: watch the metrics below and roll back on a collapse
    watch: list[WatchedMetricConfig] = field(default_factory=list)  # the metrics watched, each with its own threshold
    window: int = bounded(10, 1)  # the recent best is the best of a metric's last `window` values (before this one)
    rollback_steps: int = bounded(10, 1)  # roll back to the newest checkpoint at least this many steps before the collapse
    lr_scale: float = bounded(1.0, 0.0, 1.0)  # the learning rate is multiplied by this at every rollback (1 = unchanged)
    max_rollbacks: int = bounded(3, 0)  # rollbacks in a run; the collapse after the last one stops the run with the reason

    def cross_checks(self, checkpoint_every: int, keep_checkpoints: int, synchronous: bool) -> list[tuple[str, str]]:
        if not self.enabled:
            return []
        problems = [(f"guard.watch[{index}].name", "must name a logged metric")
                    for index, watched in enumerate(self.watch) if not watched.name]
        if not self.watch:
            problems.append(("guard.watch", "needs at least one metric when guard.enabled"))
        reach = checkpoint_every * (keep_checkpoints - 1)
        if reach < self.rollback_steps:
            problems.append(("guard.rollback_steps", f"{self.rollback_steps} steps back needs kept checkpoints that reach that far: "
                             f"learner.checkpoint_every × (learner.keep_checkpoints − 1) = {reach}"))
        if synchronous:
            problems.append(("guard.enabled", "the synchronous reference (learner.mode=synchronous) has no guard"))
        return problems
