"""The calculator tool of the built-in `calculator` environment, as both sides of a row see it: the row key that
picks the call format, the function tool's schema, the text of a call in each format, and what the tool answers.
The environment (`rollout_servers.environments.calculator`) reads model turns and answers with it; the demo's
task (`demo.tasks.calculator`) writes rows and its teacher's calls and answers with it.

Expressions are integers joined by + - * (no parentheses, no other characters, at most
`MAX_EXPRESSION_CHARS`), evaluated with the usual precedence without `eval`.
"""

from __future__ import annotations

import json
import re

from asyncrl.environments.base import Tool

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
