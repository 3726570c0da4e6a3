"""The synthetic tasks by `task.name`: how `asyncrl data` splits and writes them, and, for multi-turn
tasks, the teacher episodes the warm start learns from."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from asyncrl.config.sections import TaskConfig
from demo.tasks import arithmetic, calculator, guess_number
from demo.tasks.dialogue import Dialogue
from demo.tasks.splits import Problem, TaskSplit, split_task

Teacher = Callable[[random.Random, TaskConfig, float, frozenset[str]], Dialogue]  # (rng, task, label noise, held out)


@dataclass(frozen=True)
class TaskKind:
    split: Callable[[TaskConfig, int], TaskSplit]  # (task, seed) → held-out and training problems
    make_row: Callable[[Problem, int, str, TaskConfig], dict[str, Any]]  # (problem, index, split, task) → verl row
    teacher: Teacher | None  # multi-turn teacher episodes; None = single-turn (question → answer)


def _arithmetic_row(problem: Problem, index: int, split: str, task: TaskConfig) -> dict[str, Any]:
    return arithmetic.make_row(*problem, index, split)


TASKS: dict[str, TaskKind] = {
    "arithmetic": TaskKind(split_task, _arithmetic_row, None),
    "calculator": TaskKind(split_task, calculator.make_row, calculator.teacher_dialogue),
    "guess_number": TaskKind(guess_number.split, guess_number.make_row, guess_number.teacher_dialogue),
}


def task_kind(task: TaskConfig) -> TaskKind:
    return TASKS[task.name]
