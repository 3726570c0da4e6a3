"""Waiting for a condition in a test: poll it, return as soon as it holds, and fail naming what was awaited
once the timeout has passed (or at once, when `give_up` says the wait can no longer succeed, e.g. the process
that should make the condition true has exited). A test waits for what it needs this way, never with a sleep
sized for a slow machine: it goes on the moment the condition holds, and a condition that never holds fails
with a message rather than a wrong assertion further on."""

from __future__ import annotations

import asyncio
import subprocess
import time
from typing import Callable, TypeVar

POLL_S = 0.01  # between two checks of the condition: short, checks are cheap

_T = TypeVar("_T")


def wait_until(condition: Callable[[], _T], timeout_s: float, what: str, *, poll_s: float = POLL_S,
               give_up: Callable[[], str | None] = lambda: None, context: Callable[[], str] = lambda: "") -> _T:
    """The first truthy value of `condition()`. AssertionError naming `what` after `timeout_s`, or with the
    reason `give_up()` returns (checked before each poll) once it returns one; `context()` (e.g. the tail of
    a log) ends either message."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        reason = give_up()
        assert reason is None, f"gave up waiting for {what}: {reason}\n{context()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s\n{context()}"
        time.sleep(poll_s)
    return value


async def wait_until_async(condition: Callable[[], _T], timeout_s: float, what: str, *,
                           poll_s: float = POLL_S) -> _T:
    """`wait_until` inside an event loop: the loop runs its other tasks between two checks."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        await asyncio.sleep(poll_s)
    return value


def holds_within(condition: Callable[[], object], timeout_s: float, poll_s: float = POLL_S) -> bool:
    """Whether `condition()` holds within `timeout_s`, for a wait whose end is no failure (e.g. a grace
    period before SIGKILL): True as soon as it does."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def exited(process: subprocess.Popen) -> Callable[[], str | None]:
    """A `give_up` for waits on something `process` should do: the wait ends once it has exited."""
    def reason() -> str | None:
        return None if process.poll() is None else f"process {process.pid} exited with {process.returncode}"
    return reason
