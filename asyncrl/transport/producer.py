"""TrajectoryProducer: what a rollout server uses to put trajectory groups into the buffer.

Sends are pipelined (up to max_in_flight unacknowledged records). A record is done only when the
buffer acknowledges it, which it does after appending it to its log. A record without an ack within
ack_timeout_s, or one the buffer was too full to take, is sent again with the same record_id, which the
buffer stores at most once. A record still unacknowledged after deadline_s raises BufferTimeout.

Sends never block: ZeroMQ refuses a message it cannot queue (no connected peer, e.g. a CURVE handshake
that failed, or a send queue full while the buffer is down), and a blocking send would then wait past
any deadline. A refused send is tried again SEND_RETRY_S later, until the record's deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from asyncrl.messages import Ack, ErrorReply, TrajectoryGroup, decode, encode
from asyncrl.transport.sockets import BufferRequestError, BufferTimeout, connect_dealer
from asyncrl.units import MS_PER_S

SEND_RETRY_S = 0.05  # a send ZeroMQ could not queue is tried again this soon


@dataclass
class _InFlight:
    frame: bytes  # encoded once; resends reuse the bytes
    deadline: float  # monotonic time by which it must be acknowledged
    resend_at: float  # monotonic time of the next resend
    attempts: int = 0  # sends tried
    refused: int = 0  # of those, sends ZeroMQ could not queue


class TrajectoryProducer:
    def __init__(self, address: str, *, curve_dir: str = "", ack_timeout_s: float = 5.0, deadline_s: float = 60.0,
                 max_in_flight: int = 64, context: zmq.Context | None = None) -> None:
        self.address = address
        self.ack_timeout_s = ack_timeout_s
        self.deadline_s = deadline_s
        self.max_in_flight = max_in_flight
        self.socket = connect_dealer(context or zmq.Context.instance(), address, curve_dir)
        self.in_flight: dict[str, _InFlight] = {}
        self.acks: list[Ack] = []  # acknowledged since the last flush
        self.resends = 0  # records sent again (no ack in time, or buffer full)

    def send(self, group: TrajectoryGroup) -> Ack:
        """Send one group and wait for its acknowledgement. A group whose last send raised BufferTimeout is
        sent again under a fresh deadline (the same record id: the buffer keeps it once)."""
        self.in_flight.pop(group.record_id, None)
        self.submit(group)
        while group.record_id in self.in_flight:
            self.pump()
        ack = next(ack for ack in self.acks if ack.record_id == group.record_id)
        self.acks.remove(ack)
        return ack

    def submit(self, group: TrajectoryGroup) -> None:
        """Send a group without waiting for its ack (blocks while max_in_flight are unacknowledged)."""
        if group.record_id not in self.in_flight:
            self.submit_encoded(group.record_id, encode(group))

    def submit_encoded(self, record_id: str, frame: bytes) -> None:
        """Send an already-encoded TrajectoryGroup (the caller vouches that `frame` encodes `record_id`)."""
        while len(self.in_flight) >= self.max_in_flight:
            self.pump()
        now = time.monotonic()
        record = _InFlight(frame, now + self.deadline_s, now + self.ack_timeout_s)
        self.in_flight[record_id] = record
        self._send(record, now)

    def flush(self) -> list[Ack]:
        """Wait until every submitted group is acknowledged; return the acks gathered since the last flush."""
        while self.in_flight:
            self.pump()
        acks, self.acks = self.acks, []
        return acks

    def pump(self) -> None:
        """Take in the acks that arrive before the next resend is due, then resend what is due (for callers that
        want acks as they come, e.g. to time them; submit, send and flush call it themselves)."""
        now = time.monotonic()
        next_due = min(min(record.resend_at, record.deadline) for record in self.in_flight.values())
        if self.socket.poll(max(0, int((next_due - now) * MS_PER_S)), zmq.POLLIN):
            while self.socket.poll(0, zmq.POLLIN):
                self._on_reply(self.socket.recv())
        self._resend_due(time.monotonic())

    def _on_reply(self, frame: bytes) -> None:
        reply = decode(frame)
        if isinstance(reply, ErrorReply):
            raise BufferRequestError(f"buffer at {self.address} rejected a frame: {reply.error}")
        if not isinstance(reply, Ack) or reply.record_id not in self.in_flight:
            return  # the ack of a resend whose first copy was already acknowledged
        if reply.retry_after_ms:
            self.in_flight[reply.record_id].resend_at = time.monotonic() + reply.retry_after_ms / MS_PER_S
            return
        del self.in_flight[reply.record_id]  # a rejection is final too: the same bytes would be refused again
        if reply.error:
            raise BufferRequestError(f"buffer at {self.address} rejected record {reply.record_id}: {reply.error}")
        self.acks.append(reply)

    def _resend_due(self, now: float) -> None:
        for record_id, record in self.in_flight.items():
            if now >= record.deadline:
                raise BufferTimeout(f"record {record_id} not acknowledged by the buffer at {self.address} "
                                    f"within {self.deadline_s:.1f}s ({record.attempts} sends, {record.refused} of "
                                    "them refused by ZeroMQ: no connected peer or a full send queue)")
            if now >= record.resend_at:
                self.resends += 1
                self._send(record, now)

    def _send(self, record: _InFlight, now: float) -> None:
        record.attempts += 1
        record.resend_at = now + self.ack_timeout_s
        try:
            self.socket.send(record.frame, zmq.NOBLOCK)
        except zmq.Again:
            record.refused += 1
            record.resend_at = now + SEND_RETRY_S

    def close(self) -> None:
        self.socket.close()
