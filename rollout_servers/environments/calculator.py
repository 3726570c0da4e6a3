"""Built-in `calculator` environment: the model may call a calculator tool and gets the result back as a
`tool` message; a turn without a tool call is its final answer, scored by exact match.

Two call formats, chosen per row by `extra_info["tool_format"]` (`task.calculator.tool_format`):
- `calc`: the model writes `<calc>EXPR</calc>`, plain characters that the tiny character-level model
  can emit without any tool machinery;
- `hermes`: the environment lists the function tool `CALCULATOR_TOOL`, the chat template shows it to the
  model, and the model calls it as an OpenAI agent's model would (`<tool_call>{"name": "calc",
  "arguments": {"expr": "43*27"}}</tool_call>`, read by vLLM's parser into `ModelTurn.tool_calls`); each
  call is answered by a tool message carrying its `tool_call_id`.

The tool itself (its schema, the text of its calls, what it answers) is shared with the demo's task that writes
the rows: `asyncrl.environments.calculator_tool`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from asyncrl.data import PromptRow
from asyncrl.environments.base import Environment, Message, ModelTurn, StepResult, Tool
from asyncrl.environments.calculator_tool import (
    ARGUMENT,
    CALC,
    CALCULATOR_TOOL,
    FUNCTION_NAME,
    HERMES,
    INVALID_EXPRESSION,
    TOOL_CLOSE,
    TOOL_FORMAT_KEY,
    TOOL_OPEN,
    TOOL_ROLE,
    evaluate,
)

_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)


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
