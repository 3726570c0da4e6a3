"""Train/validation split of the synthetic task: one seeded draw decides the held-out questions, so
that `asyncrl data` (the files), the warm start (which must never see them) and the accuracy that
`asyncrl init-model` reports all agree on which questions are held out."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from asyncrl.config.sections import TaskConfig
from demo.tasks import arithmetic

Problem = tuple[str, str]  # (question, answer)
ProblemMaker = Callable[[random.Random], Problem]  # draws one problem of a task's question space

_DRAW_ATTEMPTS_PER_PROBLEM = 20  # give up drawing when the task space is nearly exhausted


@dataclass(frozen=True)
class TaskSplit:
    val: list[Problem]  # distinct held-out problems
    train: list[Problem]  # training problems (repeats allowed), none with a held-out question

    @property
    def val_questions(self) -> frozenset[str]:
        return frozenset(question for question, _ in self.val)


def arithmetic_problems(task: TaskConfig) -> ProblemMaker:
    """Questions of `task.operators` on operands of `task.min_digits`..`task.max_digits` digits."""
    return lambda rng: arithmetic.make_problem(rng, task.min_digits, task.max_digits, task.operators)


def split_task(task: TaskConfig, seed: int) -> TaskSplit:
    """The arithmetic questions' split: held-out and training problems from the same space."""
    problems = arithmetic_problems(task)
    return split_problems(problems, problems, task, seed)


def split_problems(val_problems: ProblemMaker, train_problems: ProblemMaker, task: TaskConfig, seed: int) -> TaskSplit:
    """`task.num_val` distinct held-out problems first, then `task.num_train` training problems that avoid their
    questions."""
    rng = random.Random(seed)
    val = draw_problems(rng, val_problems, task.num_val, exclude=frozenset(), unique=True)
    train = draw_problems(rng, train_problems, task.num_train, exclude=frozenset(q for q, _ in val), unique=False)
    return TaskSplit(val=val, train=train)


def draw_problems(rng: random.Random, make: ProblemMaker, count: int, exclude: frozenset[str],
                  unique: bool) -> list[Problem]:
    """Up to `count` problems whose questions avoid `exclude` (fewer when the task space runs out)."""
    problems: list[Problem] = []
    taken: set[str] = set()
    for _ in range(count * _DRAW_ATTEMPTS_PER_PROBLEM):
        question, answer = make(rng)
        if question in exclude or (unique and question in taken):
            continue
        problems.append((question, answer))
        taken.add(question)
        if len(problems) == count:
            break
    return problems
