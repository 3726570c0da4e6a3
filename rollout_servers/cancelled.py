"""Ending tasks on purpose: cancel them and wait until each has run its cleanup and ended."""

from __future__ import annotations

import asyncio
from typing import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel `tasks` and wait for their ends; what they raise on the way out (the cancellation or an error of their
    cleanup) is theirs, not the caller's."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
