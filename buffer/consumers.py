"""A read position per consumer, so that one client's reads never move another's.

Every consumer (a client's socket identity) reads through its own `PendingWindow`: a batch request that
leaves its position to the buffer (`from_offset` -1) advances only the requester's window, and the learner's
next request, which names its own position, finds its window where it left it instead of having every pending
record read back from the log. A new consumer starts from a copy of the committing consumer's window (an
in-memory copy of the summaries, never a log read). The learner is the consumer that commits (before any
commit: the consumer served last): its window is the one new consumers copy, the stats report and the memory
budget counts. Bounded: past `limit` consumers the one used least recently is forgotten (never the
committer's) and starts again from a copy if it comes back.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from buffer.window import PendingWindow

FIRST = b""  # the consumer of the window the store starts with, until a client commits


class ConsumerWindows:
    def __init__(self, first: PendingWindow, limit: int) -> None:
        self._windows: OrderedDict[bytes, PendingWindow] = OrderedDict({FIRST: first})
        self._limit = limit
        self._current = FIRST
        self._committer: bytes | None = None  # the consumer that committed last

    def __iter__(self) -> Iterator[PendingWindow]:
        return iter(self._windows.values())

    def __len__(self) -> int:
        return len(self._windows)

    @property
    def current(self) -> PendingWindow:
        """The window of the consumer served now."""
        return self._windows[self._current]

    @property
    def learner(self) -> PendingWindow:
        """The learner's window, which the stats report and the memory budget counts: the consumer that
        committed last, or before any commit the consumer served last."""
        return self._windows[self._committer if self._committer is not None else self._current]

    def peek(self, consumer: bytes) -> PendingWindow:
        """`consumer`'s window, or the learner's for a consumer not kept, to plan on: nothing is copied, moved
        or forgotten (the loop plans for every waiting request each turn, more of them than `limit` may keep)."""
        return self._windows.get(consumer, self.learner)

    def select(self, consumer: bytes) -> None:
        """Serve `consumer` now: its window, or a copy of the learner's for a consumer not seen yet."""
        if consumer not in self._windows:
            self._windows[consumer] = self.learner.copy()
        self._windows.move_to_end(consumer)
        self._current = consumer
        self._forget_the_least_recent()

    def replace_current(self, window: PendingWindow) -> None:
        """The current consumer moved to a position its window did not hold: this window now holds it."""
        self._windows[self._current] = window

    def current_commits(self) -> None:
        """The current consumer committed: its window is the learner's from now on (it is never forgotten)."""
        self._committer = self._current

    def _forget_the_least_recent(self) -> None:
        while len(self._windows) > self._limit:
            oldest = next(consumer for consumer in self._windows if consumer not in (self._committer, self._current))
            del self._windows[oldest]
