"""The completion tokens the engine has sampled for one group so far, over every request and task its samples run in.

A group cut short when its server stops is thrown away whole: the samples that finished and what the cut ones had
sampled. Its requests' results never come back to it then, so the engine counts each request's tokens into the tally
of the task that made it, as they are known (at its end, or when it is cut); the tasks a group's samples run in copy
their context from the group's task, and with it the tally.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class WorkTally:
    tokens: int = 0  # completion tokens sampled so far


_CURRENT: ContextVar[WorkTally | None] = ContextVar("work_tally", default=None)


def start_tally() -> WorkTally:
    """A fresh tally of what the current task, and the tasks it starts from now on, have the engine sample."""
    tally = WorkTally()
    _CURRENT.set(tally)
    return tally


def count_tokens(tokens: int) -> None:
    """Add `tokens` sampled for the current task's work to its tally, if it keeps one."""
    tally = _CURRENT.get()
    if tally is not None:
        tally.tokens += tokens
