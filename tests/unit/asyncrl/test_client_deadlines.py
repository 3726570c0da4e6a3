"""Client deadlines hold whatever ZeroMQ does: no peer at all, a CURVE handshake that fails, a send queue
full because the buffer is down. Each client call runs in a thread joined with a bound, so a client that
blocks fails the test instead of hanging it."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from asyncrl.config.buffer import BufferConfig
from asyncrl.net import free_port
from demo.synthetic import synthetic_group
from asyncrl.transport import BufferConsumer, BufferTimeout, TrajectoryProducer, generate_curve_keys
from buffer.service import BufferService

DEADLINE_S = 1.0
SLACK_S = 2.0  # a busy 2-core machine may be this late on top of the deadline
QUEUE_FILLING_RECORDS = 1500  # more than ZeroMQ's default send queue (1,000 messages) holds


def finishes_in_time(call) -> BaseException | None:
    """Run `call` in a thread; return what it raised, failing if it ran past the deadline plus slack."""
    outcome: dict = {}

    def run():
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(DEADLINE_S + SLACK_S)
    assert not thread.is_alive(), f"the client was still waiting {DEADLINE_S + SLACK_S:.0f}s into a {DEADLINE_S}s deadline"
    assert time.monotonic() - start >= DEADLINE_S * 0.9
    return outcome.get("error")


def producer(address: str, curve_dir: str = "") -> TrajectoryProducer:
    return TrajectoryProducer(address, curve_dir=curve_dir, ack_timeout_s=0.2, deadline_s=DEADLINE_S,
                              max_in_flight=QUEUE_FILLING_RECORDS)


def test_a_producer_keeps_its_deadline_while_the_buffer_is_down_and_its_send_queue_fills():
    client = producer(f"tcp://127.0.0.1:{free_port()}")
    records = [synthetic_group(f"r{i}", samples=1, completion_tokens=4) for i in range(QUEUE_FILLING_RECORDS)]

    def send_all():
        for record in records:
            client.submit(record)
        client.flush()

    error = finishes_in_time(send_all)
    assert isinstance(error, BufferTimeout) and "refused by ZeroMQ" in str(error)
    client.close()


@pytest.fixture
def curve_service(tmp_path):
    keys = generate_curve_keys(tmp_path / "keys")
    config = dataclasses.replace(BufferConfig(), curve_dir=str(keys), port=free_port())
    service = BufferService(config, tmp_path / "buffer")
    thread = threading.Thread(target=service.serve, daemon=True)
    thread.start()
    yield service
    service.stop()
    thread.join(timeout=5)


def test_a_producer_whose_curve_handshake_fails_keeps_its_deadline(curve_service, tmp_path):
    other_keys = generate_curve_keys(tmp_path / "other")  # keys the buffer does not know
    for client in (producer(curve_service.endpoint), producer(curve_service.endpoint, str(other_keys))):
        error = finishes_in_time(lambda: client.send(synthetic_group("r", samples=1, completion_tokens=4)))
        assert isinstance(error, BufferTimeout) and "not acknowledged" in str(error)
        client.close()


def test_a_request_whose_curve_handshake_fails_keeps_its_deadline(curve_service):
    consumer = BufferConsumer(curve_service.endpoint, "learner", timeout_s=DEADLINE_S, resend_s=0.2)
    error = finishes_in_time(consumer.stats)
    assert isinstance(error, BufferTimeout) and "no reply to StatsRequest" in str(error)
    consumer.close()
