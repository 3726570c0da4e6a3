"""Batch requests waiting in the buffer for enough data, within caps.

A parked request costs the loop a batch plan on every turn and holds its position's `from_ahead` list,
so what clients can make the buffer hold is capped: per consumer id (a client over its own cap is
refused) and in total, by count and by the positions' size (then a request is answered at once with
what there is instead of waiting: the buffer stays responsive, and no client is refused because of
another one).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

from asyncrl.messages import BatchRequest


@dataclass
class ParkedRequest:
    identity: bytes  # ROUTER identity of the consumer
    request: BatchRequest
    deadline: float  # monotonic time after which it is answered with what there is


@dataclass(frozen=True)
class ParkingCaps:
    per_client: int  # parked requests one consumer id may have
    total: int  # parked requests of all consumers
    total_ahead: int  # `from_ahead` entries all parked requests hold together


class OverClientCap(Exception):
    """The consumer already has as many requests waiting as it may."""


class ParkedRequests:
    def __init__(self, caps: ParkingCaps) -> None:
        self.caps = caps
        self.requests: list[ParkedRequest] = []
        self._per_client: Counter[str] = Counter()
        self._ahead = 0  # from_ahead entries held by the parked requests

    def __len__(self) -> int:
        return len(self.requests)

    def check_client(self, request: BatchRequest) -> None:
        """Raise OverClientCap when this consumer may not park another request."""
        if self._per_client[request.consumer_id] >= self.caps.per_client:
            raise OverClientCap(f"consumer '{request.consumer_id}' already has {self.caps.per_client} batch "
                                "request(s) waiting (buffer.max_parked_per_client)")

    def has_room(self, request: BatchRequest) -> bool:
        """The total caps leave room for this request."""
        return (len(self.requests) < self.caps.total
                and self._ahead + len(request.from_ahead) <= self.caps.total_ahead)

    def park(self, parked: ParkedRequest) -> None:
        self.requests.append(parked)
        self._per_client[parked.request.consumer_id] += 1
        self._ahead += len(parked.request.from_ahead)

    def soonest_deadline(self) -> float | None:
        return min((parked.deadline for parked in self.requests), default=None)

    def pop_ready(self, now: float, can_fill: Callable[[ParkedRequest], bool]) -> Iterator[ParkedRequest]:
        """Remove and yield, in arrival order, the requests whose wait is over or that can be filled now.
        Lazily: the caller answers each before the next is judged (an answer takes groups away)."""
        for parked in list(self.requests):
            if now >= parked.deadline or can_fill(parked):
                self._unpark(parked)
                yield parked

    def _unpark(self, parked: ParkedRequest) -> None:
        self.requests.remove(parked)
        self._per_client[parked.request.consumer_id] -= 1
        if not self._per_client[parked.request.consumer_id]:
            del self._per_client[parked.request.consumer_id]
        self._ahead -= len(parked.request.from_ahead)
