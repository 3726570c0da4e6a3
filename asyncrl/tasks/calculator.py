"""The `calculator` task: multiplication questions ("123*45=") too hard for the tiny model to answer
unaided, and a calculator tool it can call as `<calc>123*45</calc>` (`asyncrl.environments.calculator`).

The warm-start teacher calls the tool in `task.calculator.tool_use_rate` of its episodes and copies
the result; otherwise it answers at once, with digits it gets wrong at `label_noise` or more. RL then
learns to use the tool every time.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.config.sections import TaskConfig
from asyncrl.environments.calculator import TOOL_ROLE, evaluate, tool_call
from asyncrl.tasks import arithmetic
from asyncrl.tasks.dialogue import Dialogue
from asyncrl.tasks.arithmetic import noisy_answer
from asyncrl.tasks.splits import Problem, draw_problems

DATA_SOURCE = "calculator"
UNAIDED_NOISE = 0.5  # digit error rate of the teacher's unaided answers at least (it cannot multiply in its head)


def make_row(problem: Problem, index: int, split: str, task: TaskConfig) -> dict[str, Any]:
    question, answer = problem
    return arithmetic.make_row(question, answer, index, split) | {"data_source": DATA_SOURCE, "ability": "tool_use"}


def teacher_dialogue(rng: random.Random, task: TaskConfig, label_noise: float, held_out: frozenset[str]) -> Dialogue:
    """One teacher episode on a fresh problem whose question is not held out."""
    ((question, answer),) = draw_problems(rng, task, 1, exclude=held_out, unique=False)
    messages = [{"role": "user", "content": question}]
    if rng.random() >= task.calculator.tool_use_rate:
        return Dialogue(messages, [(noisy_answer(answer, max(label_noise, UNAIDED_NOISE), rng), [])])
    expression = question.rstrip("=")
    result = evaluate(expression)
    return Dialogue(messages, [(tool_call(expression), [{"role": TOOL_ROLE, "content": result}]),
                               (noisy_answer(result, label_noise, rng), [])])
