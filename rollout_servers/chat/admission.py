"""Chat sessions under buffer admission: a session takes a place within the staleness bound when it opens
and gives it back when it closes or is dropped.

Admission counts groups, but a session's group is known only when it closes (`group_id`, `group_size`).
So open sessions are counted as groups of `rollout.sampling.n`: the server holds ceil(open sessions / n)
grants for them, reports those among its running groups, and asks the buffer for one more grant when a
new session does not fit in what it holds. A session waiting for its place holds nothing, so the
admitted ones can always finish and close, which makes room for the waiting ones (an agent must not make
an admitted session wait for one that is not admitted yet).
"""

from __future__ import annotations

import asyncio
import collections


def _groups(sessions: int, sessions_per_group: int) -> int:
    return -(-sessions // sessions_per_group)  # ceiling division


class ChatAdmission:
    def __init__(self, sessions_per_group: int) -> None:
        self.sessions_per_group = sessions_per_group  # rollout.sampling.n: sessions counted as one group
        self.held = 0  # admission grants held for open sessions (reported as running groups)
        self.open = 0  # sessions admitted and not yet closed or dropped
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Sessions waiting for a place."""
        return len(self._waiting)

    def wanted(self) -> int:
        """Grants the waiting sessions need beyond those held."""
        return max(0, _groups(self.open + self.waiting, self.sessions_per_group) - self.held)

    def take_grants(self, granted: int) -> int:
        """Take up to `wanted()` of the `granted` groups for waiting sessions; return the rest."""
        taken = min(granted, self.wanted())
        self.held += taken
        self._admit_waiting()
        return granted - taken

    async def enter(self, timeout_s: float) -> None:
        """Wait for a place for a new session; TimeoutError after `timeout_s` (the session then holds nothing)."""
        if not self._waiting and self._fits():
            self.open += 1
            return
        place = asyncio.get_running_loop().create_future()
        self._waiting.append(place)
        try:
            await asyncio.wait_for(asyncio.shield(place), timeout_s)
        except BaseException:  # timed out, or the request was cancelled: give up the place either way
            if place.done():
                self.leave()
            else:
                self._waiting.remove(place)
                place.cancel()
            raise

    def leave(self) -> None:
        """A session closed or was dropped: its place goes to a waiting session, or its grant back to the buffer."""
        self.open -= 1
        self._admit_waiting()
        self.held = min(self.held, _groups(self.open, self.sessions_per_group))

    def _fits(self) -> bool:
        return self.open < self.held * self.sessions_per_group

    def _admit_waiting(self) -> None:
        while self._waiting and self._fits():
            self.open += 1
            self._waiting.popleft().set_result(None)
