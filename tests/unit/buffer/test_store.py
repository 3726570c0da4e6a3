from __future__ import annotations

import dataclasses

import pytest

from buffer.group_summary import summarize_group
from asyncrl.messages import encode
from demo.synthetic import synthetic_group
from buffer.store import OffsetError, TrajectoryStore
from buffer.window import BatchLimits

TOKENS = 16


def records(ids, version: int = 0, started_at: int = -1):
    """Groups sampled by `version` that started while the learner was at `started_at` (-1: not recorded)."""
    groups = [synthetic_group(str(i), completion_tokens=TOKENS, version=version) for i in ids]
    frames = [encode(dataclasses.replace(group, learner_version_at_start=started_at)) for group in groups]
    return [(summarize_group(frame), frame) for frame in frames]


def taken_ids(store: TrajectoryStore, selection) -> list[str]:
    """Record ids of the selection's groups, as the store hands them out (read back from its log)."""
    return [summarize_group(frame).record_id for frame in store.frames(selection.taken)]


def test_resends_are_acknowledged_but_stored_once(tmp_path, small_config):
    store = TrajectoryStore(small_config, tmp_path)
    first = store.ingest(records(range(3)))
    again = store.ingest(records([1, 3, 3]))  # a resend, a new one, and the new one twice in one batch
    assert [r.offset for r in first] == [0, 1, 2]
    assert [(r.offset, r.duplicate) for r in again] == [(1, True), (3, False), (3, True)]
    assert store.end_offset == 4
    store.close()
    restarted = TrajectoryStore(small_config, tmp_path)  # the id index is rebuilt from the log
    assert [(r.offset, r.duplicate) for r in restarted.ingest(records([0, 2, 4]))] == [(0, True), (2, True), (4, False)]


def test_restart_resumes_from_the_committed_offset(tmp_path, small_config):
    store = TrajectoryStore(small_config, tmp_path)
    store.ingest(records(range(10)))
    assert taken_ids(store, store.take(BatchLimits(0, 1, max_samples=4))) == ["0", "1", "2", "3"]
    store.commit(4, policy_version=1)
    store.take(BatchLimits(0, 1, max_samples=4))  # handed out, not committed: the consumer crashed
    store.close()
    restarted = TrajectoryStore(small_config, tmp_path)
    assert (restarted.committed.offset, restarted.committed.policy_version) == (4, 1)
    assert taken_ids(restarted, restarted.take(BatchLimits(1, 1))) == [str(i) for i in range(4, 10)]


def test_seek_rewinds_to_the_checkpoint_and_forward_past_handed_out(tmp_path, small_config):
    store = TrajectoryStore(small_config, tmp_path)
    store.ingest(records(range(30)))  # several segments
    store.take(BatchLimits(0, 1, max_samples=20))
    store.commit(5, 0)
    store.seek(5)  # the consumer restarted from a checkpoint at offset 5
    assert taken_ids(store, store.take(BatchLimits(0, 1, max_samples=3))) == ["5", "6", "7"]
    store.seek(25)
    assert taken_ids(store, store.take(BatchLimits(0, 1))) == [str(i) for i in range(25, 30)]
    with pytest.raises(OffsetError):
        store.seek(4)  # below the commit: released
    with pytest.raises(OffsetError):
        store.seek(31)


def test_commit_releases_segments_and_their_ids(tmp_path, small_config):
    store = TrajectoryStore(small_config, tmp_path)
    store.ingest(records(range(40)))
    segments_before = len(store.log.segments)
    store.take(BatchLimits(0, 1, max_samples=30))
    store.commit(30, 0)
    assert len(store.log.segments) < segments_before
    assert store.log.first_offset <= 30
    assert min(store.ids.values()) == store.log.first_offset
    with pytest.raises(OffsetError):
        store.commit(29, 0)


def test_full_memory_budget_asks_to_retry_and_frees_after_handout(tmp_path, small_config):
    frame_bytes = len(records([0])[0][1])
    config = dataclasses.replace(small_config, max_memory_bytes=int(3.5 * frame_bytes))  # sizes vary
    store = TrajectoryStore(config, tmp_path)
    results = store.ingest(records(range(5)))
    assert [r.full for r in results] == [False, False, False, True, True]
    assert store.end_offset == 3
    store.take(BatchLimits(0, 1, max_samples=2))
    assert [r.full for r in store.ingest(records(range(3, 6)))] == [False, False, True]


def test_full_disk_budget_waits_for_a_commit(tmp_path, small_config):
    frame_bytes = len(records([0])[0][1])
    config = dataclasses.replace(small_config, max_disk_bytes=12 * frame_bytes)
    store = TrajectoryStore(config, tmp_path)
    stored = sum(not r.full for r in store.ingest(records(range(20))))
    assert stored < 20
    store.take(BatchLimits(0, 1))
    assert all(r.full for r in store.ingest(records([100])))  # handed out but not committed: still on disk
    store.commit(stored, 0)
    assert not store.ingest(records([100]))[0].full


def test_accepted_excludes_stale_drops_across_restarts(tmp_path, small_config):
    store = TrajectoryStore(small_config, tmp_path)
    store.ingest(records(range(4), version=0, started_at=5) + records(range(4, 6), version=5, started_at=5))
    selection = store.take(BatchLimits(policy_version=5, max_staleness=1))
    assert len(selection.dropped) == 4 and store.accepted == 2
    store.commit(6, 5)
    store.close()
    assert TrajectoryStore(small_config, tmp_path).accepted == 2


def test_records_waiting_for_their_fsync_are_known_but_not_handed_out(tmp_path, small_config):
    store = TrajectoryStore(small_config, tmp_path)
    results, first = store.write(records(range(2)), defer_fsync=True)
    again, second = store.write(records([1, 2]), defer_fsync=True)  # a resend of a record awaiting fsync, and a new one
    assert [(r.offset, r.duplicate) for r in results + again] == [(0, False), (1, False), (1, True), (2, False)]
    assert store.end_offset == 0 and store.take(BatchLimits(0, 1)).taken == []
    assert store.publish(1) == [first]
    assert store.end_offset == 2 and taken_ids(store, store.take(BatchLimits(0, 1))) == ["0", "1"]
    assert store.publish(1) == [second] and store.end_offset == 3


def test_a_failed_fsync_cuts_every_record_awaiting_it_out_of_the_log(tmp_path, small_config):
    store = TrajectoryStore(small_config, tmp_path)
    store.ingest(records([0]))
    store.write(records(range(1, 20)), defer_fsync=True)  # crosses segments (4 kB each)
    store.write(records([20]), defer_fsync=True)
    assert len(store.discard_awaiting_fsync()) == 2
    assert (store.end_offset, store.log.end_offset) == (1, 1)
    assert [(r.offset, r.duplicate) for r in store.ingest(records([5, 0]))] == [(1, False), (0, True)]
    store.close()
    assert TrajectoryStore(small_config, tmp_path).end_offset == 2


def test_a_commit_with_records_taken_ahead_survives_a_restart(tmp_path, small_config):
    store = TrajectoryStore(small_config, tmp_path)
    store.ingest(records(range(3), version=1) + records([3], version=0))  # the oldest group arrived last
    assert taken_ids(store, store.take(BatchLimits(1, 1, max_samples=1))) == ["3"]
    assert store.window.position() == (0, [3])
    store.commit(0, 1, ahead=[3])
    store.close()
    restarted = TrajectoryStore(small_config, tmp_path)
    assert (restarted.committed.offset, restarted.committed.ahead) == (0, [3])
    assert taken_ids(restarted, restarted.take(BatchLimits(1, 1))) == ["0", "1", "2"]
    with pytest.raises(OffsetError, match="committed but not consumed"):
        restarted.seek(0, [])  # a consumer position older than the commit would train group 3 twice


def test_stale_drops_ahead_of_the_commit_stay_counted_across_restarts(tmp_path, small_config):
    store = TrajectoryStore(small_config, tmp_path)
    store.ingest(records(range(2), version=5, started_at=5) + records([2], version=0, started_at=5))
    selection = store.take(BatchLimits(policy_version=5, max_staleness=1, max_samples=1))
    assert [e.offset for e in selection.taken] == [0] and [e.offset for e in selection.dropped] == [2]
    store.commit(1, 5, ahead=[2])
    assert store.accepted == 2
    store.close()
    restarted = TrajectoryStore(small_config, tmp_path)
    assert restarted.accepted == 2 and restarted.committed.dropped_ahead == [2]
    assert taken_ids(restarted, restarted.take(BatchLimits(5, 1))) == ["1"]
