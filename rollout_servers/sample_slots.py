"""A server's generation capacity (`rollout.max_inflight`) counted in samples, not groups.

A group holds one slot per sample until that sample is finished. With long-tailed lengths most of a
group's samples finish while its longest one still generates; counting whole groups would leave their
slots idle until the group completes, and the engine would run far below `max_inflight` requests.
"""

from __future__ import annotations

from typing import Awaitable, Callable, TypeVar

_T = TypeVar("_T")
SampleDone = Callable[[], None]  # told once per finished sample of a group


async def reporting_done(sample: Awaitable[_T], done: SampleDone | None) -> _T:
    """Await one sample, then tell `done` (also when it failed or was cancelled: its slot is free either way)."""
    try:
        return await sample
    finally:
        if done is not None:
            done()


class SampleSlots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # samples generated at once at most (rollout.max_inflight)
        self.in_use = 0  # slots held by unfinished samples

    def free_groups(self, group_size: int, running_groups: int) -> int:
        """Groups of `group_size` samples that fit now; one whenever none runs, so that a group larger than
        the capacity still gets sampled."""
        fitting = max(0, self.capacity - self.in_use) // group_size
        return fitting if running_groups else max(1, fitting)

    def claim(self, samples: int) -> Claim:
        """Hold a slot for each of a new group's `samples`."""
        return Claim(self, samples)


class Claim:
    """One group's slots: one per sample not yet finished."""

    def __init__(self, slots: SampleSlots, samples: int) -> None:
        self._slots = slots
        self._held = 0
        self._take(samples)

    def sample_done(self) -> None:
        """One of the group's samples finished (or was stopped): its slot is free."""
        self._take(-min(1, self._held))

    def release(self) -> None:
        """The group is done: free whatever it still holds."""
        self._take(-self._held)

    def _take(self, count: int) -> None:
        self._held += count
        self._slots.in_use += count
