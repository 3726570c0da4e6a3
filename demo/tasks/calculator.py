"""The `calculator` task: multiplication questions ("123*45=") too hard for the tiny model to answer
unaided, and a calculator tool it can call (`asyncrl.environments.calculator_tool`): as `<calc>123*45</calc>`,
or with `task.calculator.tool_format=hermes` as a function tool listed by the chat template and called
in vLLM's hermes format, the way an OpenAI agent's model calls functions.

The warm-start teacher calls the tool in `task.calculator.tool_use_rate` of its episodes and copies
the result; otherwise it answers at once, with digits it gets wrong at `label_noise` or more. RL then
learns to use the tool every time.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.config.sections import TaskConfig
from asyncrl.environments.calculator_tool import (
    CALCULATOR_TOOL,
    HERMES,
    TOOL_FORMAT_KEY,
    TOOL_ROLE,
    evaluate,
    function_call,
    tool_call,
)
from demo.tasks import arithmetic
from demo.tasks.dialogue import Dialogue
from demo.tasks.arithmetic import noisy_answer
from demo.tasks.splits import Problem, arithmetic_problems, draw_problems

DATA_SOURCE = "calculator"
UNAIDED_NOISE = 0.5  # digit error rate of the teacher's unaided answers at least (it cannot multiply in its head)
TEACHER_CALL_ID = "call_0"  # the id of the teacher's function call (ids are never rendered into the prompt)


def make_row(problem: Problem, index: int, split: str, task: TaskConfig) -> dict[str, Any]:
    question, answer = problem
    row = arithmetic.make_row(question, answer, index, split) | {"data_source": DATA_SOURCE, "ability": "tool_use"}
    row["extra_info"][TOOL_FORMAT_KEY] = task.calculator.tool_format
    return row


def teacher_dialogue(rng: random.Random, task: TaskConfig, label_noise: float, held_out: frozenset[str]) -> Dialogue:
    """One teacher episode on a fresh problem whose question is not held out."""
    ((question, answer),) = draw_problems(rng, arithmetic_problems(task), 1, exclude=held_out, unique=False)
    messages = [{"role": "user", "content": question}]
    tools = [CALCULATOR_TOOL] if task.calculator.tool_format == HERMES else None
    if rng.random() >= task.calculator.tool_use_rate:
        return Dialogue(messages, [(noisy_answer(answer, max(label_noise, UNAIDED_NOISE), rng), [])], tools)
    expression = question.rstrip("=")
    result = evaluate(expression)
    if tools:
        call, reply = function_call(expression), {"role": TOOL_ROLE, "tool_call_id": TEACHER_CALL_ID, "content": result}
    else:
        call, reply = tool_call(expression), {"role": TOOL_ROLE, "content": result}
    return Dialogue(messages, [(call, [reply]), (noisy_answer(result, label_noise, rng), [])], tools)
