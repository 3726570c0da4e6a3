"""Well-formed control messages with extreme field values hit the live buffer process while a good
producer and a good learner work: the buffer never crashes, stats always answer, and every
acknowledged group reaches the learner exactly once."""

from __future__ import annotations

import random
import threading
import time

import pytest
import zmq

from asyncrl.messages import AdmissionRequest, BatchRequest, Commit, PolicyVersion, StatsRequest, encode
from demo.synthetic import synthetic_group
from asyncrl.transport import BufferConsumer, TrajectoryProducer
from asyncrl.transport.sockets import connect_dealer
from waiting import wait_until

pytestmark = pytest.mark.slow

GROUPS = 300
EXTREMES = [-2**63, -2**63 + 1, -2**31 - 1, -2, -1, 2**31 - 1, 2**31, 2**53, 2**53 + 1, 2**63 - 1, 2**64 - 1]
STATS_EVERY_S = 0.05
STATS_TIMEOUT_S = 5.0
WORK_DEADLINE_S = 120
# Hostile messages the buffer takes before the test ends: the good learner and the stats go on until then. The good
# work alone can end in a fraction of a second, before the fuzzing thread got the GIL often (15 sent once, under load).
MIN_HOSTILE = 200


def extreme(rng: random.Random) -> int:
    return rng.choice(EXTREMES)


def hostile_message(rng: random.Random):
    """A control message that encodes fine, with at least one number at an extreme."""
    ids = ["evil", "learner", "x" * rng.choice([1, 256, 257, 10_000])]
    return rng.choice([
        lambda: BatchRequest(rng.choice(ids), extreme(rng), extreme(rng), extreme(rng), extreme(rng) % 2**64,
                             extreme(rng), [extreme(rng) for _ in range(rng.randint(0, 3))]),
        lambda: BatchRequest(rng.choice(ids), extreme(rng), from_offset=-1),
        lambda: AdmissionRequest(rng.choice(ids), extreme(rng), extreme(rng), str(rng.random()), extreme(rng)),
        lambda: Commit(rng.choice(ids), rng.choice([-1, 2**53, 2**63 - 1, -2**63]), extreme(rng), [extreme(rng)]),
        lambda: PolicyVersion(rng.choice([-1, 2**31, 2**63 - 1, 2**64 - 1, -2**63])),
        lambda: StatsRequest("y" * rng.choice([0, 257, 100_000])),
    ])()


def fuzz(address: str, stop: threading.Event, sent: list[int]) -> None:
    rng = random.Random(1)
    dealer = connect_dealer(zmq.Context.instance(), address)
    while not stop.is_set():
        dealer.send(encode(hostile_message(rng)), zmq.NOBLOCK)
        sent[0] += 1
        while dealer.poll(0):
            dealer.recv()
        time.sleep(0.001)  # the behaviour under test: a steady stream of hostile messages, not a flood
    dealer.close()


def watch_stats(address: str, stop: threading.Event, answered: list[float]) -> None:
    """Ask for stats all along; each round trip must answer (BufferTimeout/BufferRequestError otherwise)."""
    consumer = BufferConsumer(address, "watcher", timeout_s=STATS_TIMEOUT_S, resend_s=STATS_TIMEOUT_S)
    while not stop.is_set():
        start = time.perf_counter()
        consumer.stats()
        answered.append(time.perf_counter() - start)
        time.sleep(STATS_EVERY_S)  # the behaviour under test: a stats request every STATS_EVERY_S all along
    consumer.close()


def test_extreme_control_messages_harm_no_one(buffer_process):
    buffer = buffer_process("buffer.max_staleness=1000")
    stop, sent, stats_round_trips, failures = threading.Event(), [0], [], []

    def guarded(target, *args):
        def run():
            try:
                target(*args)
            except BaseException as error:  # noqa: BLE001 - reported by the test
                failures.append(error)
        return threading.Thread(target=run, daemon=True)

    background = [guarded(fuzz, buffer.address, stop, sent), guarded(watch_stats, buffer.address, stop, stats_round_trips)]
    for thread in background:
        thread.start()

    acked: set[str] = set()

    def produce():
        producer = TrajectoryProducer(buffer.address, ack_timeout_s=2, deadline_s=60, max_in_flight=8)
        for index in range(GROUPS):
            producer.submit(synthetic_group(f"good-{index}", completion_tokens=16))
        acked.update(ack.record_id for ack in producer.flush())

    wait_until(lambda: sent[0] > 0 or failures, WORK_DEADLINE_S, "the first hostile message")  # under fire from the start
    producer_thread = guarded(produce)
    producer_thread.start()
    learner = BufferConsumer(buffer.address, "learner", start_offset=0, timeout_s=10)
    received: list[str] = []
    deadline = time.monotonic() + WORK_DEADLINE_S
    while time.monotonic() < deadline and (producer_thread.is_alive() or len(received) < len(acked)
                                           or sent[0] < MIN_HOSTILE):
        batch = learner.next_batch(0, max_samples=16, wait_s=0.1)
        received += [group.record_id for group in batch.groups]
        learner.commit(0)
    stop.set()
    for thread in [producer_thread, *background]:
        thread.join(timeout=10)

    assert not failures, failures
    assert len(acked) == GROUPS and sorted(received) == sorted(acked)  # every acked group once, none twice
    stats = learner.stats()
    print(f"{sent[0]} hostile messages, {stats.rejected_frames} rejected, {stats.refused_requests} refused; "
          f"{len(stats_round_trips)} stats round trips, max {max(stats_round_trips) * 1000:.1f} ms")
    assert sent[0] >= MIN_HOSTILE and stats.rejected_frames + stats.refused_requests > sent[0] // 2
    assert buffer.process.poll() is None, "the buffer process died"
