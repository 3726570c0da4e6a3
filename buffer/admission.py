"""Admission control: how many new prompt groups rollout servers may start (AReaL's bound).

Capacity = (K + version + 1) · batch_groups − (accepted + running), where `accepted` counts groups
stored for training (stored minus dropped as stale) and `running` the groups granted to servers and
not yet reported finished. With the learner taking batch_groups per step this keeps every group
within K versions of the learner when it is trained on; the read-time check enforces the bound
whatever happens. A server that stops asking for admission_timeout_s has its running groups released.
A request the client had to resend (its reply was lost or late) carries the same id and gets the
first answer again, without counting its finished groups or its grant twice. A server that reports its
own running count is taken at its word: a restarted buffer, whose counts start empty, then knows
what each server has in flight from its first request on instead of admitting past the bound.
Leases are capped in number (`max_leases`; their ids are capped in size at decode): a new server past
the cap is refused until a silent one's lease expires.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from asyncrl.staleness import admission_capacity

log = logging.getLogger(__name__)


@dataclass
class ServerLease:
    running: int = 0  # groups granted and not reported finished
    last_seen: float = 0.0  # monotonic time of the last request
    waiting_since: float | None = None  # when the server was first granted less than it wanted
    last_request: str = ""  # id of the last request applied
    last_grant: int = 0  # what it was granted


class LeasesFull(Exception):
    """A new server asked for admission while every lease is held."""


class Admission:
    def __init__(self, max_staleness: int, batch_groups: int, timeout_s: float, max_leases: int = 1024) -> None:
        self.max_staleness = max_staleness
        self.batch_groups = batch_groups
        self.timeout_s = timeout_s
        self.max_leases = max_leases
        self.leases: dict[str, ServerLease] = {}
        self.waits = 0  # requests granted fewer groups than wanted
        self.wait_s = 0.0  # time servers spent short of what they wanted, summed
        self.released = 0  # groups released from servers that timed out

    @property
    def running(self) -> int:
        return sum(lease.running for lease in self.leases.values())

    def capacity(self, version: int, accepted: int) -> int:
        return admission_capacity(version, self.max_staleness, self.batch_groups, accepted, self.running)

    def grant(self, server_id: str, wanted: int, finished: int, version: int, accepted: int, now: float,
              request_id: str = "", running: int = -1) -> int:
        """Record the server's finished groups (or its own running count, when it reports one: >= 0), then
        grant up to `wanted` within capacity; a repeat of the last request (same non-empty id) gets the
        same grant and changes nothing. Raises LeasesFull for a new server while all leases are held."""
        lease = self._lease(server_id)
        if request_id and request_id == lease.last_request:
            lease.last_seen = now
            return lease.last_grant
        lease.running = running if running >= 0 else max(0, lease.running - max(0, finished))
        lease.last_seen = now
        granted = max(0, min(wanted, self.capacity(version, accepted)))
        lease.running += granted
        if granted < wanted:
            self.waits += 1
            lease.waiting_since = now if lease.waiting_since is None else lease.waiting_since
        elif lease.waiting_since is not None:
            self.wait_s += now - lease.waiting_since
            lease.waiting_since = None
        lease.last_request, lease.last_grant = request_id, granted
        return granted

    def _lease(self, server_id: str) -> ServerLease:
        if server_id not in self.leases and len(self.leases) >= self.max_leases:
            raise LeasesFull(f"all {self.max_leases} admission leases are held (buffer.max_leases); "
                             f"server '{server_id}' gets one when a silent server's lease expires")
        return self.leases.setdefault(server_id, ServerLease())

    def expire(self, now: float) -> None:
        """Release the running groups of servers silent for longer than the timeout."""
        for server_id, lease in list(self.leases.items()):
            if now - lease.last_seen > self.timeout_s:
                if lease.running:
                    log.warning("server %s silent for %.1fs: releasing %d admitted groups", server_id,
                                now - lease.last_seen, lease.running)
                self.released += lease.running
                del self.leases[server_id]
