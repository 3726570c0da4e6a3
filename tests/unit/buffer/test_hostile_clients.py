"""Clients that send extreme numbers or ask the buffer to hold too much, against the live service over
loopback TCP: each is refused (ErrorReply), counted, and harms no other client."""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import zmq

from asyncrl.messages import AdmissionRequest, BatchRequest, Commit, ErrorReply, PolicyVersion, decode, encode
from demo.synthetic import synthetic_group
from asyncrl.transport import AdmissionClient, BufferConsumer, BufferRequestError, TrajectoryProducer
from asyncrl.transport.sockets import connect_dealer

# Bounds on a reply, not speed: on a box busy with the suite's real jobs a plain request has taken over 5 s.
CLIENT_TIMEOUT_S = 60
REPLY_TIMEOUT_MS = CLIENT_TIMEOUT_S * 1000
LATENCY_PROBES = 50
PARKED_WAIT_MS = 600_000  # hostile requests ask to wait ten minutes (max_wait_s): none may expire while the test runs
HOSTILE_CLIENTS = 2000  # parked requests the hostile client tries to leave in the buffer (the load)


def group(record_id: str, version: int = 0):
    return synthetic_group(record_id, samples=1, completion_tokens=16, version=version)


def holding_groups(serve, config, count: int) -> tuple:
    """A buffer served with `config` that acknowledged groups g0 … g{count-1}, and the learner reading it from offset 0."""
    service = serve(config)
    producer = TrajectoryProducer(service.endpoint)
    for i in range(count):
        producer.submit(group(f"g{i}"))
    producer.flush()
    return service, BufferConsumer(service.endpoint, "learner", start_offset=0, timeout_s=CLIENT_TIMEOUT_S)


def raw_request(address: str, message) -> object:
    socket = connect_dealer(zmq.Context.instance(), address)
    try:
        socket.send(encode(message))
        assert socket.poll(REPLY_TIMEOUT_MS), "the buffer did not answer"
        return decode(socket.recv())
    finally:
        socket.close()


EXTREME_REQUESTS = [
    BatchRequest("evil", policy_version=-2**63),
    BatchRequest("evil", policy_version=2**63 - 1),
    BatchRequest("evil", policy_version=0, max_samples=-2**63),
    BatchRequest("evil", policy_version=0, timeout_ms=2**64 - 1),
    BatchRequest("evil", policy_version=0, from_offset=-2**63),
    BatchRequest("evil", policy_version=0, from_ahead=[2**40]),  # a list without a position
    AdmissionRequest("evil", wanted=2**64 - 1),
    AdmissionRequest("evil", wanted=1, running=2**64 - 1),
    AdmissionRequest("evil", wanted=1, finished=-2**63),
    AdmissionRequest("x" * 100_000, wanted=1),
    Commit("evil", offset=-1, policy_version=0),
    Commit("evil", offset=0, policy_version=-2**63),
    PolicyVersion(2**64 - 1),
]


@pytest.mark.parametrize("message", EXTREME_REQUESTS, ids=lambda m: type(m).__name__)
def test_an_extreme_number_is_refused_at_decode_and_stats_keep_answering(serve, small_config, message):
    service = serve(small_config)
    assert TrajectoryProducer(service.endpoint).send(group("waiting", version=0)).offset == 0
    assert isinstance(raw_request(service.endpoint, message), ErrorReply)
    assert isinstance(raw_request(service.endpoint, message), ErrorReply)  # twice: sums would overflow too
    consumer = BufferConsumer(service.endpoint, "learner", timeout_s=CLIENT_TIMEOUT_S)
    stats = consumer.stats()
    assert stats.rejected_frames == 2 and stats.admission_running == 0 and stats.policy_version == 0
    assert [g.record_id for g in consumer.next_batch(0).groups] == ["waiting"]
    assert consumer.stats().staleness_histogram == {0: 1}


def test_a_position_the_buffer_cannot_serve_is_refused_and_counted(serve, small_config):
    service = serve(small_config)
    reply = raw_request(service.endpoint, BatchRequest("evil", 0, from_offset=10**9))
    assert isinstance(reply, ErrorReply) and "outside the servable range" in reply.error
    stats = BufferConsumer(service.endpoint, "learner", timeout_s=CLIENT_TIMEOUT_S).stats()
    assert (stats.refused_requests, stats.refused_over_caps, stats.rejected_frames) == (1, 0, 0)


def test_a_wait_over_max_wait_s_is_refused(serve, small_config):
    service = serve(dataclasses.replace(small_config, max_wait_s=1.0))
    reply = raw_request(service.endpoint, BatchRequest("greedy", 0, max_samples=5, timeout_ms=2000, from_offset=0))
    assert isinstance(reply, ErrorReply) and "max_wait_s" in reply.error
    assert BufferConsumer(service.endpoint, "learner", timeout_s=CLIENT_TIMEOUT_S).stats().refused_over_caps == 1


def test_admission_leases_are_capped_and_the_servers_holding_one_keep_being_served(serve, small_config):
    service = serve(dataclasses.replace(small_config, max_leases=2))
    honest = AdmissionClient(service.endpoint, "honest", timeout_s=CLIENT_TIMEOUT_S)
    assert honest.request(wanted=1).granted == 1
    assert AdmissionClient(service.endpoint, "evil-0", timeout_s=CLIENT_TIMEOUT_S).request(wanted=1).granted == 1
    with pytest.raises(BufferRequestError, match="max_leases"):
        AdmissionClient(service.endpoint, "evil-1", timeout_s=CLIENT_TIMEOUT_S).request(wanted=1)
    assert honest.request(wanted=1, finished=1).granted == 1
    stats = BufferConsumer(service.endpoint, "learner", timeout_s=CLIENT_TIMEOUT_S).stats()
    assert (stats.admission_leases, stats.refused_over_caps, stats.admission_running) == (2, 1, 2)


def _park(socket: zmq.Socket, consumer_id: str) -> None:
    """Ask the buffer to hold a batch request that can never be filled (it wants a million samples)."""
    socket.send(encode(BatchRequest(consumer_id, 0, max_samples=10**6, timeout_ms=PARKED_WAIT_MS, from_offset=0)))


def _replies(socket: zmq.Socket, count: int) -> list:
    replies = []
    while len(replies) < count and socket.poll(REPLY_TIMEOUT_MS):
        replies.append(decode(socket.recv()))
    return replies


def _latencies_ms(consumer: BufferConsumer) -> tuple[float, float]:
    """Median round trip (ms) of the learner's stats request and of a batch request."""
    stats_ms, batch_ms = [], []
    for _ in range(LATENCY_PROBES):
        start = time.perf_counter()
        consumer.stats()
        stats_ms.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        consumer.next_batch(0, max_samples=1)
        batch_ms.append((time.perf_counter() - start) * 1000)
    return statistics.median(stats_ms), statistics.median(batch_ms)


def test_a_client_over_its_caps_is_refused_while_the_learner_is_served_at_normal_latency(serve, small_config):
    config = dataclasses.replace(small_config, max_parked_per_client=2, max_parked=16, segment_bytes=2**20,
                                 max_message_bytes=2**20)
    service, learner = holding_groups(serve, config, 200)
    quiet = _latencies_ms(learner)

    hostile = connect_dealer(zmq.Context.instance(), service.endpoint)
    try:
        for _ in range(3):  # one over its own cap
            _park(hostile, "evil")
        for i in range(HOSTILE_CLIENTS):  # a consumer id per request: the total cap bounds them
            _park(hostile, f"evil-{i}")
        answered = _replies(hostile, HOSTILE_CLIENTS + 3 - 16)  # all but the 16 the total cap lets wait
        loaded = _latencies_ms(learner)
        stats = learner.stats()
    finally:
        hostile.close()
    refusals = [reply for reply in answered if isinstance(reply, ErrorReply)]
    assert len(refusals) == 1 and "max_parked_per_client" in refusals[0].error
    print(f"learner round trips, median ms: quiet stats {quiet[0]:.2f} batch {quiet[1]:.2f}; "
          f"under {HOSTILE_CLIENTS} parking attempts stats {loaded[0]:.2f} batch {loaded[1]:.2f}")
    assert (stats.parked, stats.refused_over_caps) == (16, 1)
    assert stats.unparked == HOSTILE_CLIENTS + 2 - 16 == len(answered) - 1
    assert loaded[0] < max(5 * quiet[0], 20.0) and loaded[1] < max(5 * quiet[1], 20.0)


def test_another_consumer_reading_costs_the_learner_no_log_reread_and_no_records(serve, small_config):
    """A second client reads batches at its own position: the learner's next request finds its own window where
    it left it (before, the buffer had one read cursor: the learner's next request re-read every pending record
    from the log), and the learner still gets every group exactly once."""
    service, learner = holding_groups(serve, small_config, 12)
    trained = [g.record_id for g in learner.next_batch(0, max_samples=4).groups]
    learner.commit(0)
    other = BufferConsumer(service.endpoint, "other", timeout_s=CLIENT_TIMEOUT_S)  # no position: the buffer's cursor for it
    taken_by_other = [g.record_id for _ in range(3) for g in other.next_batch(0, max_samples=2).groups]
    trained += [g.record_id for g in learner.next_batch(0, max_samples=8).groups]
    stats = learner.stats()
    assert sorted(trained) == sorted(f"g{i}" for i in range(12)) and len(trained) == 12
    assert taken_by_other == [f"g{i}" for i in range(4, 10)]  # it started where the learner's window stood
    assert stats.position_rereads == 0
    assert stats.consumers == 3  # the learner, the other client, and the window the buffer started with
