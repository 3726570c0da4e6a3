"""Dynamic task weights: the learner moves sampling weight from tasks whose reward stopped improving to
tasks still improving, and the rollout servers draw prompts with the weights it publishes.

A task is one training file, named by its rows' data_source. Each step the scheduler reads the task's
metric (`data.task_weights.metric`); a value above the task's best by more than `min_delta` is a new best.
A task with no new best for `patience` steps is stalled; one with a new best within the last `patience` steps
is improving; one not measured yet is neither. When some task is stalled and another improving, each stalled
task's share is multiplied by `factor`, never below `min_weight`, and what it gave up goes to the improving
tasks in proportion to their shares. A task just cut is not cut again for `patience` steps (nor counts as
improving: only a new best does that). Shares always sum to 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from asyncrl.config.task_weights import TASK_PLACEHOLDER, TaskWeightsConfig
from asyncrl.data.rows import PromptRow

WEIGHT_METRIC = "tasks/{task}/weight"  # a task's share of the prompts drawn, logged every step
PLATEAU_METRIC = "tasks/{task}/steps_since_best"  # steps since the task's metric last improved


class TaskNameError(ValueError):
    """A training file's task cannot be named (several data sources in it, or the same as another file's)."""


def file_tasks(files: Sequence[str], sources: Sequence[Sequence[PromptRow]]) -> list[str]:
    """The task of each training file: the one data_source its rows share."""
    names = []
    for path, rows in zip(files, sources):
        found = sorted({row.data_source for row in rows})
        if len(found) != 1:
            raise TaskNameError(f"data.task_weights needs one data_source per training file; '{path}' holds {found}")
        if found[0] in names:
            raise TaskNameError(f"data.task_weights: '{path}' and '{files[names.index(found[0])]}' both hold data_source "
                                f"'{found[0]}'; merge them or give them different data sources")
        names.append(found[0])
    return names


@dataclass
class _Task:
    name: str
    share: float  # of the prompts drawn; shares sum to 1
    best: float | None = None  # best value of its metric so far (None: not measured yet)
    best_step: int = 0  # step of its last new best
    cut_step: int | None = None  # step of its last cut (None: never cut)


class TaskWeightScheduler:
    def __init__(self, tasks: Sequence[str], weights: Sequence[float], settings: TaskWeightsConfig) -> None:
        """`weights`: the configured data.weights (empty = uniform), normalised to shares."""
        raw = list(weights) or [1.0] * len(tasks)
        self.settings = settings
        self.tasks = [_Task(name, weight / sum(raw)) for name, weight in zip(tasks, raw)]

    @property
    def weights(self) -> list[float]:
        """Each task's share, in training-file order."""
        return [task.share for task in self.tasks]

    def observe(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Take step `step`'s metrics, move weight if a task stalled; returns the weights' metrics."""
        patience = self.settings.patience
        for task in self.tasks:
            value = metrics.get(self.settings.metric.replace(TASK_PLACEHOLDER, task.name))
            if value is not None and (task.best is None or value > task.best + self.settings.min_delta):
                task.best, task.best_step = value, step
        measured = [task for task in self.tasks if task.best is not None]
        improving = [task for task in measured if step - task.best_step < patience]
        stalled = [task for task in measured if task not in improving
                   and (task.cut_step is None or step - task.cut_step >= patience)]
        if stalled and improving:
            self._move(stalled, improving, step)
        return self.metrics(step)

    def metrics(self, step: int) -> dict[str, float]:
        return {name.replace(TASK_PLACEHOLDER, task.name): value for task in self.tasks for name, value in
                ((WEIGHT_METRIC, task.share), (PLATEAU_METRIC, float(step - task.best_step)))}

    def _move(self, stalled: list[_Task], improving: list[_Task], step: int) -> None:
        freed = 0.0
        for task in stalled:
            cut = max(self.settings.min_weight, task.share * self.settings.factor)
            freed += max(task.share - cut, 0.0)
            task.share, task.cut_step = min(task.share, cut), step
        receiving = sum(task.share for task in improving)
        for task in improving:  # in proportion to their shares; equally when they all have none
            task.share += freed * (task.share / receiving if receiving else 1 / len(improving))

    def state_dict(self) -> dict[str, Any]:
        """Shares, bests and patience of every task, for the learner's checkpoint."""
        return {"tasks": [vars(task).copy() for task in self.tasks]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = [task["name"] for task in state["tasks"]]
        if saved != [task.name for task in self.tasks]:
            raise ValueError(f"task weights were saved for tasks {saved}, not {[task.name for task in self.tasks]}")
        self.tasks = [_Task(**task) for task in state["tasks"]]
