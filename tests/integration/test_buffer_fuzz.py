"""Random, truncated, mutated, oversized and multi-part frames (and raw TCP garbage) hit the live buffer
process while good producers send: the good data arrives complete, the junk is rejected and counted."""

from __future__ import annotations

import random
import socket
import threading
from urllib.parse import urlparse

import pytest
import zmq

from asyncrl.messages import encode
from demo.synthetic import synthetic_group
from asyncrl.transport import BufferConsumer, TrajectoryProducer
from asyncrl.transport.sockets import connect_dealer

from buffer_helpers import drain

pytestmark = pytest.mark.slow

MAX_MESSAGE_BYTES = 65536
TOKENS = 32
PRODUCERS = 2
GROUPS_PER_PRODUCER = 150
RAW_TCP_EVERY = 20  # one raw TCP connection spraying bytes per this many zmq frames


def good_group(producer: int, index: int):
    return synthetic_group(f"good-{producer}-{index}", completion_tokens=TOKENS, seed=producer)


def junk_frames(rng: random.Random, valid: bytes) -> list[bytes]:
    """One message of junk: random bytes, a cut or mutated valid frame, an oversized or multi-part one."""
    mutated = bytearray(valid)
    for _ in range(rng.randint(1, 8)):
        mutated[rng.randrange(len(mutated))] = rng.randrange(256)
    choices = [
        [rng.randbytes(rng.randint(0, 2000))],
        [valid[: rng.randrange(len(valid))]],
        [bytes(mutated)],
        [rng.randbytes(MAX_MESSAGE_BYTES + rng.randint(1, 1000))],
        [valid, rng.randbytes(10)],
        [b""],
    ]
    return rng.choice(choices)


def fuzz(address: str, stop: threading.Event, sent: list[int]) -> None:
    rng = random.Random(0)
    dealer = connect_dealer(zmq.Context.instance(), address)
    host, port = urlparse(address).hostname, urlparse(address).port
    index = 0
    while not stop.is_set():
        valid = encode(synthetic_group(f"fuzz-{index}", completion_tokens=TOKENS))
        dealer.send_multipart(junk_frames(rng, valid))
        while dealer.poll(0):
            dealer.recv()  # error replies (and acks of mutations that still decode)
        if index % RAW_TCP_EVERY == 0:
            with socket.create_connection((host, port), timeout=5) as raw:
                raw.sendall(rng.randbytes(rng.randint(1, 4000)))
        index += 1
        sent[0] = index
    dealer.close()


def test_good_data_arrives_complete_under_fuzzing(buffer_process):
    buffer = buffer_process(f"buffer.max_message_bytes={MAX_MESSAGE_BYTES}")
    stop, fuzzed = threading.Event(), [0]
    fuzzer = threading.Thread(target=fuzz, args=(buffer.address, stop, fuzzed))
    fuzzer.start()

    def produce(producer_index: int) -> None:
        producer = TrajectoryProducer(buffer.address, ack_timeout_s=2, deadline_s=60, max_in_flight=8)
        for index in range(GROUPS_PER_PRODUCER):
            producer.submit(good_group(producer_index, index))
        producer.flush()

    producers = [threading.Thread(target=produce, args=(p,)) for p in range(PRODUCERS)]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join(timeout=120)
    stop.set()
    fuzzer.join(timeout=30)
    assert not any(thread.is_alive() for thread in producers + [fuzzer])

    consumer = BufferConsumer(buffer.address, "learner")
    good = {g.record_id: g for g in drain(consumer) if g.record_id.startswith("good-")}
    expected = {f"good-{p}-{i}": good_group(p, i) for p in range(PRODUCERS) for i in range(GROUPS_PER_PRODUCER)}
    assert good == expected
    stats = consumer.stats()
    assert fuzzed[0] > 50 and stats.rejected_frames > fuzzed[0] // 2
