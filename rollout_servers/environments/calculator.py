"""Built-in `calculator` environment: the model may call a calculator tool and gets the result back as a
`tool` message; a turn without a tool call is its final answer, scored by exact match.

Two call formats, chosen per row by `extra_info["tool_format"]` (`task.calculator.tool_format`):
- `calc`: the model writes `<calc>EXPR</calc>`, plain characters that the tiny character-level model
  can emit without any tool machinery;
- `hermes`: the environment lists the function tool `CALCULATOR_TOOL`, the chat template shows it to the
  model, and the model calls it as an OpenAI agent's model would (`<tool_call>{"name": "calc",
  "arguments": {"expr": "43*27"}}</tool_call>`, read by vLLM's parser into `ModelTurn.tool_calls`); each
  call is answered by a tool message carrying its `tool_call_id`.

Expressions are integers joined by + - * (no parentheses, no other characters, at most
`MAX_EXPRESSION_CHARS`), evaluated with the usual precedence without `eval`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from asyncrl.data import PromptRow
from asyncrl.environments.base import Environment, Message, ModelTurn, StepResult, Tool

TOOL_OPEN, TOOL_CLOSE = "<calc>", "</calc>"
TOOL_ROLE = "tool"
TOOL_FORMAT_KEY = "tool_format"  # extra_info key: "calc" (the default) or "hermes"
CALC, HERMES = "calc", "hermes"
# Names kept short: every character is a token of the tiny model, and the tool's JSON is in every prompt.
FUNCTION_NAME, ARGUMENT = "calc", "expr"
CALCULATOR_TOOL: Tool = {"type": "function", "function": {
    "name": FUNCTION_NAME, "parameters": {"type": "object", "properties": {ARGUMENT: {"type": "string"}}}}}
INVALID_EXPRESSION = "error"  # the tool's answer to an expression it cannot evaluate
MAX_EXPRESSION_CHARS = 40  # longer expressions are refused (bounds the work and the result's length)
_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)
_EXPRESSION = re.compile(r"\d+([+\-*]\d+)*")


def tool_call(expression: str) -> str:
    """The text of a model turn that calls the calculator on `expression`."""
    return f"{TOOL_OPEN}{expression}{TOOL_CLOSE}"


def function_call(expression: str) -> str:
    """The text of a model turn that calls `CALCULATOR_TOOL` on `expression` in hermes' format, exactly as the
    tiny model's chat template renders an assistant message with that call."""
    call = {"name": FUNCTION_NAME, "arguments": {ARGUMENT: expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


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
        self._format = CALC

    async def reset(self, sample: PromptRow) -> list[Message]:
        self._answer, self._tool_calls = sample.ground_truth.strip(), 0
        self._format = str((sample.extra_info or {}).get(TOOL_FORMAT_KEY, CALC))
        if self._format not in (CALC, HERMES):
            raise ValueError(f"extra_info.{TOOL_FORMAT_KEY} is '{self._format}', expected '{CALC}' or '{HERMES}'")
        return list(sample.messages)

    def tools(self) -> list[Tool] | None:
        return [CALCULATOR_TOOL] if self._format == HERMES else None

    async def step(self, turn: ModelTurn) -> StepResult:
        answers = self._function_answers(turn.tool_calls) if self._format == HERMES else self._tag_answer(turn.text)
        if answers:
            self._tool_calls += len(answers)
            return StepResult(observation=answers, info=self._info())
        reward = 1.0 if turn.text.strip() == self._answer else 0.0
        return StepResult(reward=reward, done=True, info=self._info())

    @staticmethod
    def _tag_answer(text: str) -> list[Message]:
        call = _CALL.search(text)
        return [] if call is None else [{"role": TOOL_ROLE, "content": evaluate(call.group(1))}]

    @staticmethod
    def _function_answers(calls: list[dict[str, Any]]) -> list[Message]:
        """One tool message per call, by id: the result, or an error that says what was wrong with the call."""
        return [{"role": TOOL_ROLE, "tool_call_id": call["id"], "content": _call_result(call["function"])}
                for call in calls]

    def _info(self) -> dict[str, float]:
        return {"tool_calls": float(self._tool_calls)}


def _call_result(function: dict[str, Any]) -> str:
    if function.get("name") != FUNCTION_NAME:
        return f"{INVALID_EXPRESSION}: no function '{function.get('name')}'"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return INVALID_EXPRESSION
    expression = arguments.get(ARGUMENT) if isinstance(arguments, dict) else None
    return evaluate(expression) if isinstance(expression, str) else INVALID_EXPRESSION
