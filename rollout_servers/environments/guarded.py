"""Calls into an environment with a deadline each: whatever the environment does wrong (raises, hangs,
returns something malformed) comes out as one `EnvironmentFailure` that ends the episode, not the server."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, TypeVar

from asyncrl.data.rows import ROLES
from asyncrl.environments.base import Environment, Message, ModelTurn, StepResult, Tool
from asyncrl.user_code import describe_exception

_T = TypeVar("_T")

ENV_ERROR = "env_error"  # finish reason of an episode whose environment raised or returned garbage
ENV_TIMEOUT = "env_timeout"  # finish reason of an episode whose environment ran past its deadline


class EnvironmentFailure(Exception):
    """An environment call failed; `finish_reason` is ENV_ERROR or ENV_TIMEOUT, the message says what."""

    def __init__(self, finish_reason: str, message: str) -> None:
        super().__init__(message)
        self.finish_reason = finish_reason


async def within(call: Awaitable[_T], timeout_s: float, what: str) -> _T:
    """Await `call` for at most `timeout_s`; an exception or the deadline becomes `EnvironmentFailure`."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        raise EnvironmentFailure(ENV_TIMEOUT, f"{what} ran past its {timeout_s:g}s deadline") from None
    except Exception as error:  # user code: any exception is the environment's failure, reported as such
        raise EnvironmentFailure(ENV_ERROR, f"{what} raised {describe_exception(error)}") from error


class GuardedEnvironment:
    """An environment whose every call has a deadline and whose answers are checked."""

    def __init__(self, environment: Environment, name: str) -> None:
        self.environment = environment
        self.name = name  # how the environment was named in the config, for messages

    async def reset(self, sample: Any, timeout_s: float) -> list[Message]:
        messages = await within(self.environment.reset(sample), timeout_s, f"environment '{self.name}' reset")
        return self._checked_messages(messages, "reset")

    def tools(self) -> list[Tool] | None:
        """The environment's function tools, checked to be None or a list of OpenAI function tools."""
        try:
            tools = self.environment.tools() if hasattr(self.environment, "tools") else None
        except Exception as error:  # user code
            raise EnvironmentFailure(ENV_ERROR, f"environment '{self.name}' tools() raised "
                                                f"{describe_exception(error)}") from error
        if tools is not None and not (isinstance(tools, list) and all(_is_function_tool(tool) for tool in tools)):
            raise EnvironmentFailure(ENV_ERROR, f"environment '{self.name}' tools() returned {tools!r:.80}, expected "
                                                "None or a list of {'type': 'function', 'function': {'name': ...}}")
        return tools

    async def step(self, turn: ModelTurn, timeout_s: float) -> StepResult:
        result = await within(self.environment.step(turn), timeout_s, f"environment '{self.name}' step {turn.turn}")
        if not isinstance(result, StepResult):
            raise EnvironmentFailure(ENV_ERROR, f"environment '{self.name}' step returned {type(result).__name__}, "
                                                "expected StepResult")
        if not result.done:
            self._checked_messages(result.observation, "step")
        return result

    async def close(self, timeout_s: float) -> None:
        await within(self.environment.close(), timeout_s, f"environment '{self.name}' close")

    def _checked_messages(self, messages: Any, call: str) -> list[Message]:
        problem = _message_problem(messages)
        if problem:
            raise EnvironmentFailure(ENV_ERROR, f"environment '{self.name}' {call} returned {problem}")
        return messages


def _message_problem(messages: Any) -> str:
    """Why `messages` is not a chat list ("" when it is one)."""
    if not isinstance(messages, list) or not messages:
        return f"{type(messages).__name__} {messages!r:.80}, expected a non-empty list of messages"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            return f"message {index} {message!r:.80}, expected {{'role': one of {list(ROLES)}, 'content': str}}"
    return ""


def _is_function_tool(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return tool.get("type") == "function" and isinstance(function, dict) and isinstance(function.get("name"), str)
