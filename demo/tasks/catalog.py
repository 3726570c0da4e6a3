"""The synthetic tasks by `task.name`: how `asyncrl data` splits and writes them, and what the warm start learns
from: a single-turn task's teacher responses, or a multi-turn task's teacher episodes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from asyncrl.config.sections import TaskConfig
from demo.tasks import arithmetic, calculator, guess_number, scratchpad
from demo.tasks.dialogue import Dialogue
from demo.tasks.splits import Problem, ProblemMaker, TaskSplit, arithmetic_problems, split_task

Teacher = Callable[[random.Random, TaskConfig, float, frozenset[str]], Dialogue]  # (rng, task, label noise, held out)


@dataclass(frozen=True)
class SingleTurn:
    """The teacher of a question → response task, and how init-model scores the model's responses."""

    problems: Callable[[TaskConfig], ProblemMaker]  # the training questions' space
    response: Callable[[Problem, float, random.Random], str]  # (problem, label noise, rng) → the teacher's response
    data_source: str  # the rows' data source: its built-in scorer rates a response


@dataclass(frozen=True)
class TaskKind:
    split: Callable[[TaskConfig, int], TaskSplit]  # (task, seed) → held-out and training problems
    make_row: Callable[[Problem, int, str, TaskConfig], dict[str, Any]]  # (problem, index, split, task) → verl row
    teacher: SingleTurn | Teacher  # a single-turn task's teacher, or a multi-turn task's teacher episodes


def _arithmetic_row(problem: Problem, index: int, split: str, task: TaskConfig) -> dict[str, Any]:
    return arithmetic.make_row(*problem, index, split)


def _noisy_answer(problem: Problem, noise: float, rng: random.Random) -> str:
    return arithmetic.noisy_answer(problem[1], noise, rng)


def _scratchpad_problems(task: TaskConfig) -> ProblemMaker:
    return scratchpad.problems(task.scratchpad, task.scratchpad.tail)


TASKS: dict[str, TaskKind] = {
    "arithmetic": TaskKind(split_task, _arithmetic_row,
                           SingleTurn(arithmetic_problems, _noisy_answer, arithmetic.DATA_SOURCE)),
    "calculator": TaskKind(split_task, calculator.make_row, calculator.teacher_dialogue),
    "guess_number": TaskKind(guess_number.split, guess_number.make_row, guess_number.teacher_dialogue),
    "scratchpad": TaskKind(scratchpad.split, scratchpad.make_row,
                           SingleTurn(_scratchpad_problems, scratchpad.worked_solution, scratchpad.DATA_SOURCE)),
}


def task_kind(task: TaskConfig) -> TaskKind:
    return TASKS[task.name]
