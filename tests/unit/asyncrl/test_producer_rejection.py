"""A record the buffer rejects is final: the producer raises for it once and never sends it again, so the next
group (a chat session's after a refused one, say) goes through. A ROUTER socket plays the buffer."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from asyncrl.messages import Ack, decode, encode
from asyncrl.transport import TrajectoryProducer
from asyncrl.transport.sockets import BufferRequestError
from demo.synthetic import synthetic_group

DEADLINE_S = 10.0


class RejectingBuffer:
    """Rejects records whose id is in `rejected` and stores the rest; counts what it received per record."""

    def __init__(self, rejected: set[str]) -> None:
        self.rejected = rejected
        self.received: list[str] = []
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(50):
                continue
            identity, frame = self.socket.recv_multipart()
            record_id = decode(frame).record_id
            self.received.append(record_id)
            ack = (Ack(record_id=record_id, offset=-1, error="malformed") if record_id in self.rejected
                   else Ack(record_id=record_id, offset=len(self.received)))
            self.socket.send_multipart([identity, encode(ack)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
        self.socket.close(linger=0)


def test_a_rejected_record_raises_once_and_is_never_sent_again():
    refused, accepted = synthetic_group(record_id="refused"), synthetic_group(record_id="accepted")
    buffer = RejectingBuffer({"refused"})
    producer = TrajectoryProducer(f"tcp://127.0.0.1:{buffer.port}", ack_timeout_s=0.05, deadline_s=DEADLINE_S)
    try:
        with pytest.raises(BufferRequestError, match="rejected record refused: malformed"):
            producer.send(refused)
        assert producer.in_flight == {}
        time.sleep(0.1)  # past the 50 ms resend time: a refused record still in flight would be sent again now
        ack = producer.send(accepted)
        assert (ack.record_id, ack.error) == ("accepted", "")
        assert buffer.received == ["refused", "accepted"]
    finally:
        producer.close()
        buffer.close()
