"""The service in a thread of the test process, driven through the real clients over loopback TCP."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import zmq

from asyncrl.messages import Ack, ErrorReply, decode, encode
from asyncrl.net import free_port
from demo.synthetic import synthetic_group
from asyncrl.transport import (AdmissionClient, BufferConsumer, BufferRequestError, BufferTimeout,
                               TrajectoryProducer, generate_curve_keys)
from asyncrl.transport.sockets import bind_router, connect_dealer
from buffer.service import BufferService
from waiting import wait_until

REPLY_TIMEOUT_MS = 5000
TOKENS = 16
RESEND_S = 0.2  # clients' resend period in the restart test
PARK_S = 1.0  # how long that test's batch request may wait in the buffer


def group(record_id: str, version: int = 0, samples: int = 1, started_at: int = -1):
    """A group sampled by `version` that started while the learner was at `started_at` (-1: not recorded)."""
    sampled = synthetic_group(record_id, samples=samples, completion_tokens=TOKENS, version=version)
    return dataclasses.replace(sampled, learner_version_at_start=started_at)


def raw_reply(address: str, *frames: bytes):
    socket = connect_dealer(zmq.Context.instance(), address)
    socket.send_multipart(list(frames))
    assert socket.poll(REPLY_TIMEOUT_MS), "the buffer did not answer"
    reply = decode(socket.recv())
    socket.close()
    return reply


def test_ingest_ack_batch_commit_and_stats(serve, small_config):
    service = serve(small_config)
    producer = TrajectoryProducer(service.endpoint)
    assert producer.send(group("a")).offset == 0
    for i in range(5):
        producer.submit(group(f"b{i}"))
    assert sorted(ack.offset for ack in producer.flush()) == [1, 2, 3, 4, 5]  # send() took its own ack
    resent = producer.send(group("b2"))
    assert (resent.offset, resent.duplicate) == (3, True)

    consumer = BufferConsumer(service.endpoint, "learner")
    batch = consumer.next_batch(policy_version=0, max_samples=4)
    assert [g.record_id for g in batch.groups] == ["a", "b0", "b1", "b2"]
    assert (batch.offsets, batch.next_offset, consumer.position) == ([0, 1, 2, 3], 4, 4)
    assert consumer.commit(policy_version=1).committed_offset == 4
    stats = consumer.stats()
    assert (stats.ingested, stats.duplicates, stats.handed_out, stats.size) == (6, 1, 4, 2)
    assert stats.policy_version == 1 and stats.staleness_histogram == {0: 4}


def test_only_groups_that_started_outside_the_bound_are_dropped_and_the_work_is_counted(serve, small_config):
    service = serve(dataclasses.replace(small_config, max_staleness="1"))
    producer = TrajectoryProducer(service.endpoint)
    # (version of the first token, learner version at the start): g0 and g4 started 2 and 3 versions behind
    starts = [(0, 2), (2, 2), (1, 2), (3, 3), (0, 3), (0, 1)]
    for i, (version, learner) in enumerate(starts):
        producer.submit(group(f"g{i}", version=version, samples=2, started_at=learner))
    producer.flush()
    consumer = BufferConsumer(service.endpoint, "learner")
    batch = consumer.next_batch(policy_version=3)
    assert [g.record_id for g in batch.groups] == ["g1", "g2", "g3", "g5"]  # g5: 3 versions old now, started within 1
    assert batch.dropped_stale == 2 and batch.next_offset == 6
    stats = consumer.stats()
    assert stats.dropped_stale == 2 and stats.staleness_histogram == {1: 1, 2: 1, 0: 1, 3: 1}
    assert (stats.ingested_samples, stats.ingested_response_tokens) == (12, 12 * TOKENS)
    assert (stats.handed_out_samples, stats.handed_out_response_tokens) == (8, 8 * TOKENS)
    assert stats.dropped_stale_response_tokens == 4 * TOKENS
    assert (stats.first_generated_samples, stats.first_generated_response_tokens) == (8, 8 * TOKENS)


def test_the_oldest_groups_go_out_first_and_a_restart_from_the_commit_resumes_without_duplicates(serve, small_config,
                                                                                                   tmp_path):
    config = dataclasses.replace(small_config, max_staleness="1")
    service = serve(config, tmp_path / "log")
    producer = TrajectoryProducer(service.endpoint)
    for i, version in enumerate([1, 1, 0, 1]):  # g2 holds the oldest tokens (a long response) and came late
        producer.submit(group(f"g{i}", version=version))
    producer.flush()
    learner = BufferConsumer(service.endpoint, "learner")
    first = learner.next_batch(policy_version=1, max_samples=2)
    assert [g.record_id for g in first.groups] == ["g0", "g2"] and not first.dropped_stale
    assert (first.next_offset, first.next_ahead) == (1, [2])
    learner.commit(policy_version=1)
    assert [g.record_id for g in learner.next_batch(policy_version=1, max_samples=1).groups] == ["g1"]
    service.stop()  # g1 was handed out but not committed: a restarted learner trains it again, g2 not

    restarted = serve(config, tmp_path / "log")
    fresh = BufferConsumer(restarted.endpoint, "learner")  # no checkpoint: pins the buffer's position
    resumed = BufferConsumer(restarted.endpoint, "learner-from-checkpoint", start_offset=1, start_ahead=[2])
    assert [g.record_id for g in fresh.next_batch(policy_version=2).groups] == ["g1", "g3"]
    stats = fresh.stats()  # the groups read back from the log count on the generated side as they go out
    assert (stats.first_generated_samples, stats.first_generated_response_tokens) == (
        stats.handed_out_samples, stats.handed_out_response_tokens) != (0, 0)
    assert [g.record_id for g in resumed.next_batch(policy_version=2).groups] == ["g1", "g3"]
    assert (resumed.position, resumed.ahead) == (4, [])


def test_a_long_group_that_arrives_versions_late_is_handed_out(serve, small_config):
    service = serve(dataclasses.replace(small_config, max_staleness="1"))
    producer = TrajectoryProducer(service.endpoint)
    producer.send(group("short", version=0, started_at=0))
    learner = BufferConsumer(service.endpoint, "learner")
    assert [g.record_id for g in learner.next_batch(policy_version=0, max_samples=1).groups] == ["short"]
    learner.publish_version(6)  # the learner tells the buffer every version it reaches
    producer.send(group("long", version=0, started_at=0))  # its last token came long after, at version 6
    producer.send(group("fresh", version=6, started_at=6))
    batch = learner.next_batch(policy_version=6)
    assert [g.record_id for g in batch.groups] == ["long", "fresh"] and batch.dropped_stale == 0
    assert learner.stats().staleness_histogram == {0: 2, 6: 1}


def test_bad_frames_are_rejected_counted_and_service_keeps_serving(serve, small_config):
    service = serve(dataclasses.replace(small_config, max_message_bytes=4096))
    good = encode(group("ok"))
    bad_frames = [
        (os.urandom(100),),
        (good[: len(good) // 2],),
        (good, good),  # two frames in one message
        (b"\x00" * 5000,),  # over the size limit
        (encode(Ack("x", 1)),),  # a kind the buffer does not take
    ]
    for frames in bad_frames:
        assert isinstance(raw_reply(service.endpoint, *frames), ErrorReply)
    producer = TrajectoryProducer(service.endpoint)
    assert producer.send(group("ok")).offset == 0
    assert BufferConsumer(service.endpoint, "learner").stats().rejected_frames == len(bad_frames)


def test_a_group_with_token_versions_no_server_could_sample_is_refused_at_ingest(serve, small_config, tmp_path):
    service = serve(small_config, tmp_path / "log")
    producer, learner = TrajectoryProducer(service.endpoint), BufferConsumer(service.endpoint, "learner")
    with pytest.raises(BufferRequestError, match=r"rejected record garbage: token_versions holds -2147483648"):
        producer.send(group("garbage", version=-2**31))
    assert producer.send(group("unknown-learner", version=40)).offset == 0, "no version heard yet: no upper bound"
    learner.publish_version(5)
    assert producer.send(group("unversioned", version=-1)).offset == 1, "-1 marks a token without a version"
    assert producer.send(group("just-sent", version=6)).offset == 2, "weights go out before the buffer hears them"
    with pytest.raises(BufferRequestError, match=r"token_versions holds 7, past the learner's newest version 5 \+ 1"):
        producer.send(group("future", version=7))
    stats = learner.stats()
    assert (stats.ingested, stats.rejected_frames) == (3, 2) and not producer.in_flight
    service.stop()

    restarted = serve(small_config, tmp_path / "log")  # still knows version 5: the servers may hold 6
    producer = TrajectoryProducer(restarted.endpoint)
    assert producer.send(group("after-restart", version=6)).offset == 3
    with pytest.raises(BufferRequestError, match="token_versions holds 7"):
        producer.send(group("future-again", version=7))


def test_a_waiting_batch_request_is_answered_when_enough_data_arrives(serve, small_config):
    service = serve(small_config)
    consumer = BufferConsumer(service.endpoint, "learner")
    started = time.monotonic()
    assert consumer.next_batch(0, max_samples=2, wait_s=0.3).groups == []
    assert time.monotonic() - started >= 0.3

    def produce_later():  # once the request waits in the buffer
        wait_until(lambda: service.parked, REPLY_TIMEOUT_MS / 1000, "the batch request parked")
        TrajectoryProducer(service.endpoint).send(group("late", samples=2))

    thread = threading.Thread(target=produce_later)
    thread.start()
    started = time.monotonic()
    batch = consumer.next_batch(0, max_samples=2, wait_s=10)
    thread.join()
    assert [g.record_id for g in batch.groups] == ["late"]
    assert time.monotonic() - started < 5


def test_a_full_buffer_slows_producers_without_losing_records(serve, small_config):
    frame_bytes = len(encode(group("x0")))
    service = serve(dataclasses.replace(small_config, max_memory_bytes=3 * frame_bytes, retry_after_ms=10))
    producer = TrajectoryProducer(service.endpoint, deadline_s=20)

    def produce():
        for i in range(8):
            producer.submit(group(f"x{i}"))
        producer.flush()

    thread = threading.Thread(target=produce)
    thread.start()
    consumer = BufferConsumer(service.endpoint, "learner")
    received = []
    deadline = time.monotonic() + 20
    while len(received) < 8 and time.monotonic() < deadline:
        received += [g.record_id for g in consumer.next_batch(0, max_samples=1, wait_s=1).groups]
    thread.join(timeout=20)
    assert sorted(received) == [f"x{i}" for i in range(8)]  # each once; retries may reorder
    assert producer.resends > 0 and consumer.stats().full_rejections > 0


def test_admission_over_the_wire(serve, small_config):
    service = serve(dataclasses.replace(small_config, max_staleness="1", batch_groups=4))
    admission = AdmissionClient(service.endpoint, "server-0")
    assert admission.request(wanted=10).granted == 8  # (1 + 0 + 1) * 4
    assert admission.request(wanted=1).granted == 0
    consumer = BufferConsumer(service.endpoint, "learner")
    assert consumer.publish_version(2).policy_version == 2
    grant = admission.request(wanted=10, finished=3)  # (1 + 2 + 1) * 4 - (0 + 5)
    assert (grant.granted, grant.policy_version) == (10, 2)
    assert consumer.stats().admission_waits == 2  # the first two requests got less than wanted


def test_a_study_lag_equal_to_k_admits_one_batch_per_version(serve, small_config):
    """buffer.study_lag_versions = K: the servers sample with weights K versions back, so admission plans from that
    version: (K + (version − K) + 1) · batch − (accepted + running) opens one batch per learner version."""
    service = serve(dataclasses.replace(small_config, max_staleness="3", study_lag_versions=3, batch_groups=4))
    admission = AdmissionClient(service.endpoint, "server-0")
    assert admission.request(wanted=10).granted == 4  # (3 + (0 − 3) + 1) * 4 − 0
    assert admission.request(wanted=10).granted == 0
    consumer = BufferConsumer(service.endpoint, "learner")
    consumer.publish_version(1)
    grant = admission.request(wanted=10, finished=4)  # (3 + (1 − 3) + 1) * 4 − (0 + 0): the 4 were never sent
    assert (grant.granted, grant.policy_version) == (8, 1)  # the grant carries the learner's own version


def test_the_learners_k_moves_admission_selection_and_the_grants(serve, small_config):
    service = serve(dataclasses.replace(small_config, max_staleness="1", batch_groups=4))
    admission = AdmissionClient(service.endpoint, "server-0")
    first = admission.request(wanted=20)
    assert (first.granted, first.max_staleness) == (8, 1)  # (1 + 0 + 1) * 4
    producer = TrajectoryProducer(service.endpoint)
    for i, version in enumerate([0, 1, 2]):
        producer.submit(group(f"g{i}", version=version))
    producer.flush()
    consumer = BufferConsumer(service.endpoint, "learner")
    # at version 3 with K = 1 only g2 is fresh enough; the learner's K = 3 keeps all three
    batch = consumer.next_batch(policy_version=3, max_staleness=3)
    assert [g.record_id for g in batch.groups] == ["g0", "g1", "g2"] and batch.dropped_stale == 0
    grant = admission.request(wanted=20, finished=3)  # (3 + 3 + 1) * 4 - (3 accepted + 5 running)
    assert (grant.granted, grant.max_staleness) == (20, 3)
    consumer.next_batch(policy_version=3, max_staleness=0)  # K lowered to 0: nothing more may start
    assert admission.request(wanted=5).granted == 0 and admission.request(wanted=5).max_staleness == 0
    assert consumer.stats().max_staleness == 0
    consumer.next_batch(policy_version=3)  # a request naming no K leaves the buffer's as it is
    assert consumer.stats().metrics()["buffer/max_staleness"] == 0.0


def test_admission_takes_the_servers_running_count_over_the_wire(serve, small_config):
    service = serve(dataclasses.replace(small_config, max_staleness="1", batch_groups=4))
    admission = AdmissionClient(service.endpoint, "server-0")
    # as after a buffer restart: the buffer has no count of its own, the server says 5 are still running
    assert admission.request(wanted=10, finished=1, running=5).granted == 3  # (1 + 0 + 1) * 4 - (0 + 5)
    assert service.admission.running == 8


def test_commit_errors_are_reported_not_fatal(serve, small_config):
    service = serve(small_config)
    consumer = BufferConsumer(service.endpoint, "learner")
    with pytest.raises(BufferRequestError, match="commit of offset 5"):
        consumer.commit(0, offset=5)
    with pytest.raises(BufferRequestError, match="outside the servable range"):
        BufferConsumer(service.endpoint, "other", start_offset=9).next_batch(0)
    assert consumer.stats().end_offset == 0


def test_curve_keys_admit_only_clients_holding_them(serve, small_config, tmp_path):
    keys = generate_curve_keys(tmp_path / "keys")
    service = serve(dataclasses.replace(small_config, curve_dir=str(keys)))
    assert TrajectoryProducer(service.endpoint, curve_dir=str(keys)).send(group("secure")).offset == 0
    with pytest.raises(BufferTimeout):
        BufferConsumer(service.endpoint, "intruder", timeout_s=0.5).stats()


def test_non_loopback_bind_needs_keys():
    with pytest.raises(ValueError, match="CURVE"):
        bind_router(zmq.Context.instance(), "0.0.0.0", 0, 1024, security=None)


def test_an_unlimited_batch_still_fits_the_frame_limit(serve, small_config):
    service = serve(dataclasses.replace(small_config, max_message_bytes=4096))
    producer = TrajectoryProducer(service.endpoint)
    for i in range(20):
        producer.submit(group(f"m{i}"))
    producer.flush()
    consumer = BufferConsumer(service.endpoint, "learner")
    batch = consumer.next_batch(0)
    assert 1 < len(batch.groups) < 20
    assert len(encode(batch)) <= 4096


def test_a_failing_request_is_answered_and_the_service_goes_on(serve, small_config, monkeypatch):
    service = serve(small_config)
    monkeypatch.setattr(service.admission, "grant", lambda *args: 1 / 0)
    with pytest.raises(BufferRequestError, match="internal error"):
        AdmissionClient(service.endpoint, "server-0").request(wanted=1)
    assert TrajectoryProducer(service.endpoint).send(group("after")).offset == 0


def test_a_failed_background_fsync_is_retried_by_the_producer_and_stored_once(serve, small_config, monkeypatch):
    service = serve(small_config)  # fsync=batch: the helper thread runs the fsync
    real_fsync, failures = os.fsync, []

    def fail_once(fd):
        if not failures:
            failures.append(fd)
            raise OSError(5, "I/O error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fail_once)
    producer = TrajectoryProducer(service.endpoint, ack_timeout_s=5)
    for i in range(4):
        producer.submit(group(f"f{i}"))
    acks = producer.flush()
    assert failures and producer.resends > 0
    assert sorted(ack.offset for ack in acks) == [0, 1, 2, 3]
    batch = BufferConsumer(service.endpoint, "learner").next_batch(0)
    assert sorted(g.record_id for g in batch.groups) == [f"f{i}" for i in range(4)]


def test_a_request_lost_with_a_stopped_buffer_is_answered_by_its_successor(serve, small_config, tmp_path):
    config = dataclasses.replace(small_config, port=free_port())
    first = BufferService(config, tmp_path / "log")
    thread = threading.Thread(target=first.serve, daemon=True)
    thread.start()
    producer = TrajectoryProducer(first.endpoint, ack_timeout_s=RESEND_S)
    for record_id in ("g0", "g1"):
        producer.submit(group(record_id))
    assert sorted(ack.offset for ack in producer.flush()) == [0, 1]
    consumer = BufferConsumer(first.endpoint, "learner", resend_s=RESEND_S)
    assert [g.record_id for g in consumer.next_batch(0, max_samples=1).groups] == ["g0"]
    result: dict = {}
    waiting = threading.Thread(target=lambda: result.setdefault("batch", consumer.next_batch(0, max_samples=3, wait_s=PARK_S)))
    waiting.start()
    # only g1 is there: the request waits in the buffer, and dies with it
    wait_until(lambda: first.parked, REPLY_TIMEOUT_MS / 1000, "the batch request parked")
    first.stop()
    thread.join(timeout=5)

    second = serve(config, tmp_path / "log")  # same directory, same address
    assert second.endpoint == first.endpoint
    for record_id in ("g2", "g3"):
        producer.submit(group(record_id))  # the producer's socket reconnects by itself
    assert sorted((ack.offset, ack.duplicate) for ack in producer.flush()) == [(2, False), (3, False)]
    waiting.join(timeout=60)
    batch = result["batch"]
    assert [g.record_id for g in batch.groups] == ["g1", "g2", "g3"] and batch.offsets == [1, 2, 3]
    assert consumer.position == 4 and consumer.channel.resends >= 1


def test_acks_published_together_go_to_their_producer_as_one_message_of_one_frame_each(small_config, tmp_path):
    service = BufferService(dataclasses.replace(small_config, fsync="none"), tmp_path / "log")
    producer = connect_dealer(zmq.Context.instance(), service.endpoint)
    for record_id in ("a", "b", "c"):
        producer.send(encode(group(record_id)))
    messages = []
    while len(messages) < 3 and service.socket.poll(REPLY_TIMEOUT_MS):
        messages.append(service.socket.recv_multipart(copy=False))
    service.handle(messages)  # one turn: one write, one publish
    assert producer.poll(REPLY_TIMEOUT_MS)
    frames = producer.recv_multipart()
    assert [decode(frame) for frame in frames] == [Ack("a", 0), Ack("b", 1), Ack("c", 2)]
    producer.close()
    service.close()
