"""Crash tests with real processes: the buffer killed with SIGKILL, a producer killed mid-send,
the learner restarted from a commit."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter

import pytest

from demo.synthetic import synthetic_group
from asyncrl.transport import BufferConsumer, TrajectoryProducer

from buffer_helpers import drain, free_port
from waiting import wait_until

pytestmark = pytest.mark.slow

TOKENS = 64
WAIT_S = 30
BUSY_BOX_WAIT_S = 120  # the stream's acks and the producer's deadline: fsyncs on a box busy with the real jobs' I/O
LATEST_VERSION = 1  # version of the groups that are not late in the restart test
LATE_EVERY = 5  # in that test every fifth group holds older tokens: the buffer hands it out early


def group(record_id: str, version: int = 0):
    return synthetic_group(record_id, completion_tokens=TOKENS, version=version)


def test_kill_9_mid_stream_keeps_every_acknowledged_record_exactly_once(buffer_process):
    port = free_port()
    overrides = (f"buffer.port={port}", "buffer.segment_bytes=65536")
    first = buffer_process(*overrides)
    total = 600
    producer = TrajectoryProducer(first.address, ack_timeout_s=0.3, deadline_s=BUSY_BOX_WAIT_S, max_in_flight=32)
    failed: list[BaseException] = []

    def produce():
        try:
            for i in range(total):
                producer.submit(group(f"r{i}"))
            producer.flush()
        except BaseException as error:  # noqa: BLE001 - handed to the test's wait
            failed.append(error)

    thread = threading.Thread(target=produce)
    thread.start()
    # 1-2 s on a quiet box; on one busy with the real jobs' I/O a durable ack (an fsync) has taken far longer
    wait_until(lambda: len(producer.acks) >= total // 4, BUSY_BOX_WAIT_S, "a quarter of the records acknowledged",
               give_up=lambda: f"the producer failed: {failed[0]!r}" if failed else None)
    first.kill()
    acknowledged_before_crash = {ack.record_id for ack in list(producer.acks)}
    second = buffer_process(*overrides)
    thread.join(timeout=BUSY_BOX_WAIT_S * 2)
    assert not thread.is_alive() and not failed, failed

    received = Counter(g.record_id for g in drain(BufferConsumer(second.address, "learner")))
    assert set(received.values()) == {1}, "a record was stored twice"
    assert acknowledged_before_crash <= set(received)
    assert set(received) == {f"r{i}" for i in range(total)}


PRODUCER_SCRIPT = """
import sys
from asyncrl.messages import encode
from demo.synthetic import synthetic_group
from asyncrl.transport import TrajectoryProducer

producer = TrajectoryProducer(sys.argv[1], max_in_flight=4)
template = synthetic_group("template", completion_tokens=int(sys.argv[2]))
for i in range(10**6):
    template.record_id = f"big{i}"
    producer.submit(template)
    for ack in producer.acks:
        print(ack.record_id, flush=True)
    producer.acks.clear()
"""


def test_a_producer_killed_mid_send_leaves_no_partial_record(buffer_process, tmp_path):
    buffer = buffer_process("buffer.segment_bytes=8388608")
    child = subprocess.Popen([sys.executable, "-c", PRODUCER_SCRIPT, buffer.address, "65536"],
                             stdout=subprocess.PIPE, text=True)
    acknowledged = [child.stdout.readline().strip() for _ in range(5)]  # it is streaming by now
    child.kill()
    acknowledged += child.stdout.read().split()
    child.wait()

    consumer = BufferConsumer(buffer.address, "learner")
    stored = drain(consumer)  # every group in a batch went through the full typed decode
    assert {g.record_id for g in stored} >= set(acknowledged)
    assert all(len(g.trajectories[0].completion_ids) == 65536 for g in stored)
    assert consumer.stats().rejected_frames == 0

    buffer.stop()  # the log itself is whole: reopening finds nothing to truncate
    restarted = buffer_process("buffer.segment_bytes=8388608")
    assert "torn tail" not in (tmp_path / "buffer.log").read_text()
    assert BufferConsumer(restarted.address, "learner").stats().end_offset == len(stored)


def ids(batch) -> list[str]:
    return [g.record_id for g in batch.groups]


def store_groups(address: str, prefix: str, count: int, late_every: int = 0) -> list[str]:
    """Send `count` groups and wait for every ack; return their record ids in order. With `late_every`,
    every such group holds version-0 tokens among version-1 ones (a long response that finished late)."""
    producer = TrajectoryProducer(address)
    record_ids = [f"{prefix}{i}" for i in range(count)]
    for index, record_id in enumerate(record_ids):
        late = late_every and index % late_every == late_every - 1
        producer.submit(group(record_id, version=0 if late else LATEST_VERSION))
    producer.flush()
    return record_ids


@pytest.mark.parametrize("crash_buffer_too", [False, True])
def test_learner_restart_from_a_commit_trains_each_record_once(buffer_process, crash_buffer_too):
    port = free_port()
    overrides = (f"buffer.port={port}", "buffer.segment_bytes=16384")
    buffer = buffer_process(*overrides)
    sent = store_groups(buffer.address, "c", 60, late_every=LATE_EVERY)

    learner = BufferConsumer(buffer.address, "learner")
    trained = []
    for _ in range(3):
        trained += ids(learner.next_batch(LATEST_VERSION, max_samples=8))
    checkpoint = (learner.position, learner.ahead)  # saved with the learner's checkpoint, then committed
    assert checkpoint[1], "the late groups went out ahead of the log order"
    learner.commit(policy_version=3)
    for _ in range(2):
        learner.next_batch(LATEST_VERSION, max_samples=8)  # trained after the checkpoint, lost with the crash
    learner.close()
    if crash_buffer_too:
        buffer.kill()
        buffer = buffer_process(*overrides)

    restarted = BufferConsumer(buffer.address, "learner", start_offset=checkpoint[0], start_ahead=checkpoint[1])
    trained += [g.record_id for g in drain(restarted, LATEST_VERSION)]
    assert sorted(trained) == sorted(sent) and len(set(trained)) == len(sent)


def test_learner_keeps_its_place_across_a_buffer_crash(buffer_process):
    port = free_port()
    overrides = (f"buffer.port={port}",)
    buffer = buffer_process(*overrides)
    sent = store_groups(buffer.address, "p", 40)
    learner = BufferConsumer(buffer.address, "learner")
    trained = ids(learner.next_batch(0, max_samples=8))
    learner.commit(policy_version=1)
    trained += ids(learner.next_batch(0, max_samples=8))  # handed out, not yet committed
    buffer.kill()
    buffer_process(*overrides)
    trained += [g.record_id for g in drain(learner)]  # same client, reconnects to the restarted buffer
    assert trained == sent
