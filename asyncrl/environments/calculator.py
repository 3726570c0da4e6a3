"""Built-in `calculator` environment: the model may call a calculator tool as `<calc>EXPR</calc>` and gets
the result back as a tool message; a turn without a tool call is its final answer, scored by exact match.

The syntax is plain characters so that the tiny character-level model can emit it. Expressions are
integers joined by + - * (no parentheses, no other characters, at most `MAX_EXPRESSION_CHARS`), evaluated
with the usual precedence without `eval`.
"""

from __future__ import annotations

import re

from asyncrl.data import PromptRow
from asyncrl.environments.base import Environment, Message, ModelTurn, StepResult

TOOL_OPEN, TOOL_CLOSE = "<calc>", "</calc>"
TOOL_ROLE = "tool"
INVALID_EXPRESSION = "error"  # the tool's answer to an expression it cannot evaluate
MAX_EXPRESSION_CHARS = 40  # longer expressions are refused (bounds the work and the result's length)
_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)
_EXPRESSION = re.compile(r"\d+([+\-*]\d+)*")


def tool_call(expression: str) -> str:
    """The text of a model turn that calls the calculator on `expression`."""
    return f"{TOOL_OPEN}{expression}{TOOL_CLOSE}"


def evaluate(expression: str) -> str:
    """The value of an expression of integers and + - * as text, or INVALID_EXPRESSION."""
    expression = expression.strip()
    if len(expression) > MAX_EXPRESSION_CHARS or not _EXPRESSION.fullmatch(expression):
        return INVALID_EXPRESSION
    total = 0
    for term in re.split(r"(?=[+-])", expression):  # each term keeps its sign; products inside terms
        sign = -1 if term.startswith("-") else 1
        product = 1
        for factor in term.lstrip("+-").split("*"):
            product *= int(factor)
        total += sign * product
    return str(total)


class CalculatorEnvironment(Environment):
    """Answer a question, optionally with calculator calls; reward 1 for the exact final answer."""

    def __init__(self) -> None:
        self._answer = ""
        self._tool_calls = 0

    async def reset(self, sample: PromptRow) -> list[Message]:
        self._answer, self._tool_calls = sample.ground_truth.strip(), 0
        return list(sample.messages)

    async def step(self, turn: ModelTurn) -> StepResult:
        call = _CALL.search(turn.text)
        if call is not None:
            self._tool_calls += 1
            return StepResult(observation=[{"role": TOOL_ROLE, "content": evaluate(call.group(1))}],
                              info=self._info())
        reward = 1.0 if turn.text.strip() == self._answer else 0.0
        return StepResult(reward=reward, done=True, info=self._info())

    def _info(self) -> dict[str, float]:
        return {"tool_calls": float(self._tool_calls)}
