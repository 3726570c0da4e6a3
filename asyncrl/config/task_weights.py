"""`data.task_weights`: the sampling weights of the training files follow how each task learns."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config.fields import bounded

TASK_PLACEHOLDER = "{task}"  # stands for a task's name (the data_source of its file) in `metric`


@dataclass
class TaskWeightsConfig:
    enabled: bool = False  # True: lower the weight of a task whose metric stopped improving, in favour of those still improving
    metric: str = "critic/{task}/score/mean"  # metric watched per task; {task} = the task's data_source (e.g. val/{task}/score/mean)
    patience: int = bounded(20, 1)  # learner steps without a new best (by more than min_delta) before a task counts as stalled
    min_delta: float = bounded(0.01, 0.0)  # gain over the task's best value that counts as improving, in the metric's units
    factor: float = bounded(0.5, 0.0, 1.0)  # a stalled task's share is multiplied by this, at most once every `patience` steps
    min_weight: float = bounded(0.05, 0.0, 1.0)  # floor of every task's share of the mixture (shares sum to 1)

    def cross_checks(self, tasks: int, weights: list[float], synchronous: bool) -> list[tuple[str, str]]:
        """`tasks`: the training files; `weights`: data.weights (empty = uniform)."""
        if not self.enabled:
            return []
        problems = []
        shares = [weight / sum(weights) for weight in weights] if weights and sum(weights) > 0 else [1 / max(tasks, 1)]
        if min(shares) < self.min_weight:
            problems.append(("data.task_weights.min_weight", f"data.weights start a task at a share of {min(shares):.3g}, "
                                                             f"below the floor {self.min_weight:g}"))
        if TASK_PLACEHOLDER not in self.metric:
            problems.append(("data.task_weights.metric", f"must contain {TASK_PLACEHOLDER}, the task's name"))
        if self.min_weight * tasks > 1.0:
            problems.append(("data.task_weights.min_weight", f"{tasks} tasks cannot each keep {self.min_weight:g} of a total of 1"))
        if tasks < 2:
            problems.append(("data.task_weights.enabled", "needs at least two data.train_files to move weight between"))
        if synchronous:
            problems.append(("data.task_weights.enabled", "the synchronous reference (learner.mode=synchronous) keeps fixed weights"))
        return problems
