"""Clients of the buffer's control requests: admission for rollout servers, batches for the learner."""

from __future__ import annotations

import itertools
import uuid
from typing import Sequence

import zmq

from asyncrl.messages import (BUFFERS_OWN_STALENESS, AdmissionGrant, AdmissionRequest, Batch, BatchRequest, BufferPosition,
                              BufferStats, Commit, PolicyVersion, StatsRequest)
from asyncrl.transport.sockets import RequestChannel, RestartWatch
from asyncrl.units import MS_PER_S


class AdmissionClient:
    """A rollout server asks how many new prompt groups it may start.

    Report in `finished` every group started earlier and since sent (acknowledged) or abandoned, once.
    Each request carries an id unique to this client (a random prefix, then a count), so the buffer
    applies a request the channel had to resend only once."""

    def __init__(self, address: str, server_id: str, *, curve_dir: str = "", timeout_s: float = 30.0,
                 resend_s: float = 5.0, context: zmq.Context | None = None) -> None:
        self.server_id = server_id
        self.channel = RequestChannel(address, curve_dir, timeout_s, context, resend_s)
        self._prefix = uuid.uuid4().hex  # a restarted server's ids never repeat its previous process's
        self._numbers = itertools.count(1)

    def request(self, wanted: int, finished: int = 0, running: int = -1) -> AdmissionGrant:
        """`running`: groups started and not yet finished after this report, so that a buffer that
        restarted (and lost its count) admits no more than the bound allows (-1 = not known)."""
        request_id = f"{self._prefix}-{next(self._numbers)}"
        request = AdmissionRequest(self.server_id, wanted, finished, request_id, running)
        return self.channel.request(request, AdmissionGrant)

    def close(self) -> None:
        self.channel.close()


class BufferConsumer:
    """The learner's side: batches from its position in the log, commits, version updates, stats.

    `position` and `ahead` say what the learner has consumed: every record before `position`, and those
    at or past it listed in `ahead` (the buffer hands out the oldest groups first, not in log order). The
    learner stores both in its checkpoint and passes them back as `start_offset` and `start_ahead` after a
    restart (-1: start at the buffer's read position, which after a buffer start is its commit). Every
    batch request carries them, so a restart of either side resumes exactly where the learner is: a restarted
    buffer hands out what follows the position, not what it had handed out before it died. `watch`: the
    supervisor of a buffer restarted under this consumer (`RequestChannel`)."""

    def __init__(self, address: str, consumer_id: str, *, start_offset: int = -1, start_ahead: Sequence[int] = (),
                 curve_dir: str = "", timeout_s: float = 30.0, resend_s: float = 5.0,
                 context: zmq.Context | None = None, watch: RestartWatch | None = None) -> None:
        self.consumer_id = consumer_id
        self.position = start_offset
        self.ahead = list(start_ahead)
        self.channel = RequestChannel(address, curve_dir, timeout_s, context, resend_s, watch)

    def next_batch(self, policy_version: int, max_samples: int = 0, max_tokens: int = 0,
                   wait_s: float = 0.0, max_staleness: int = BUFFERS_OWN_STALENESS) -> Batch:
        """Whole groups for `policy_version`, none staler than `max_staleness` (K), which the buffer applies
        from now on (to admission too); by default the buffer's own K.

        Waits up to wait_s for the limit to be reached, then returns what there is (maybe nothing).
        After a BufferTimeout, calling again is safe: the request carries the position."""
        if self.position < 0:  # pin the buffer's position first, so even a lost first reply loses nothing
            stats = self.stats()
            self.position, self.ahead = stats.read_offset, stats.read_ahead
        request = BatchRequest(self.consumer_id, policy_version, max_samples, max_tokens,
                               timeout_ms=int(wait_s * MS_PER_S), from_offset=self.position, from_ahead=self.ahead,
                               max_staleness=max_staleness)
        batch = self.channel.request(request, Batch, wait_s=wait_s)
        self.position, self.ahead = batch.next_offset, batch.next_ahead
        return batch

    def commit(self, policy_version: int, offset: int | None = None, ahead: Sequence[int] = ()) -> BufferPosition:
        """Commit `offset` and `ahead` (default: the current position) once trained on and checkpointed."""
        if offset is None:
            offset, ahead = self.position, self.ahead
        return self.channel.request(Commit(self.consumer_id, offset, policy_version, list(ahead)), BufferPosition)

    def publish_version(self, version: int, weights_at: str = "") -> BufferPosition:
        """Tell the buffer the learner's new version (it widens admission)."""
        return self.channel.request(PolicyVersion(version, weights_at), BufferPosition)

    def stats(self) -> BufferStats:
        return self.channel.request(StatsRequest(self.consumer_id), BufferStats)

    def close(self) -> None:
        self.channel.close()
