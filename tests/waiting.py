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
               give_up: Callable[[], str | None] = lambda: None) -> _T:
    """The first truthy value of `condition()`; AssertionError naming `what` after `timeout_s`, or with the
    reason `give_up()` returns (checked before each poll) once it returns one."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        _check(deadline, timeout_s, what, give_up)
        time.sleep(poll_s)
    return value


async def wait_until_async(condition: Callable[[], _T], timeout_s: float, what: str, *,
                           poll_s: float = POLL_S) -> _T:
    """`wait_until` inside an event loop: the loop runs its other tasks between two checks."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        _check(deadline, timeout_s, what, lambda: None)
        await asyncio.sleep(poll_s)
    return value


def exited(process: subprocess.Popen, output: Callable[[], str] = lambda: "") -> Callable[[], str | None]:
    """A `give_up` for waits on something `process` should do: the wait ends once it has exited, with its
    exit status and the tail of `output()` (e.g. its log file)."""
    def reason() -> str | None:
        if process.poll() is None:
            return None
        return f"process {process.pid} exited with {process.returncode}\n{output()[-3000:]}"
    return reason


def _check(deadline: float, timeout_s: float, what: str, give_up: Callable[[], str | None]) -> None:
    reason = give_up()
    assert reason is None, f"gave up waiting for {what}: {reason}"
    assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
