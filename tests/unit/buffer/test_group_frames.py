"""The buffer's one-pass group check agrees with the full decoder; batches splice stored frames."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.group_summary import record_id_of, summarize_group
from asyncrl.messages import (SCHEMA_VERSION, Batch, BufferStats, DecodeError, PolicyVersion, Trajectory,
                              TrajectoryGroup, decode, encode, encode_batch)
from demo.synthetic import synthetic_group

GOOD = encode(synthetic_group("r1", samples=2, completion_tokens=8, version=3))


def accepts(check, frame: bytes) -> bool:
    try:
        check(frame)
    except DecodeError:
        return False
    return True


def full_decode_as_group(frame: bytes) -> TrajectoryGroup:
    return decode(frame, expect=TrajectoryGroup)


@settings(max_examples=300, deadline=None)
@given(cut=st.integers(0, len(GOOD)), position=st.integers(0, len(GOOD) - 1), byte=st.integers(0, 255))
def test_summary_accepts_exactly_what_decode_accepts(cut, position, byte):
    mutated = bytearray(GOOD)
    mutated[position] = byte
    for frame in (GOOD[:cut], bytes(mutated)):
        assert accepts(summarize_group, frame) == accepts(full_decode_as_group, frame)


def test_summary_matches_the_decoded_group():
    group = synthetic_group("r2", samples=3, completion_tokens=10, version=7)
    group.trajectories[1].loss_mask[:4] = [0] * 4
    group.trajectories[1].token_versions[:4] = [-1] * 4
    summary = summarize_group(encode(group))
    assert (summary.record_id, summary.num_samples, summary.num_tokens, summary.oldest_version) == (
        "r2", 3, group.num_tokens(), 7)
    assert record_id_of(encode(group)) == "r2"


def test_summary_rejects_other_kinds_and_invalid_groups():
    assert not accepts(summarize_group, encode(PolicyVersion(3)))
    group = synthetic_group("r3", completion_tokens=4)
    group.trajectories[0].loss_mask = [1, 1]
    with pytest.raises(DecodeError, match="loss_mask"):
        summarize_group(encode(group))


def test_group_staleness_ignores_samples_without_trained_tokens():
    group = synthetic_group("r4", samples=2, completion_tokens=4, version=5)
    empty = group.trajectories[1]
    empty.completion_ids, empty.behaviour_logprobs, empty.token_versions, empty.loss_mask = [], [], [], []
    assert empty.oldest_version() == -1
    assert group.oldest_version() == 5


def test_a_batch_of_spliced_frames_decodes_to_the_groups():
    groups = [synthetic_group(f"b{i}", completion_tokens=5) for i in range(3)]
    batch = decode(encode_batch([encode(g) for g in groups], [4, 6, 9], 3, 2, [4, 6, 9]))
    assert batch == Batch(groups=groups, offsets=[4, 6, 9], next_offset=3, dropped_stale=2, next_ahead=[4, 6, 9])


def test_stats_metrics_use_buffer_names():
    stats = BufferStats(size=3, size_bytes=10, log_bytes=20, read_offset=1, committed_offset=0, end_offset=4,
                        policy_version=2, ingested=4, duplicates=0, ingest_groups_per_s=1.0, ingest_bytes_per_s=5.0,
                        handed_out=1, dropped_stale=7, staleness_histogram={0: 1, 2: 3}, rejected_frames=0,
                        full_rejections=0, admission_running=0, admission_waits=0, admission_wait_s=0.0,
                        admission_released=0)
    metrics = stats.metrics()
    assert metrics["buffer/size"] == 3 and metrics["buffer/dropped_stale"] == 7
    assert metrics["buffer/staleness_2"] == 3
    assert decode(encode(stats)) == stats


def test_trajectory_fields_roundtrip():
    trajectory = Trajectory([1], [2, 3], [-0.5, 0.0], [0, -1], [1, 0], 1.0, "g", "src", "stop")
    assert trajectory.oldest_version() == 0


def test_invalid_utf8_is_a_decode_error():
    frame = msgspec.msgpack.encode((SCHEMA_VERSION, "trajectory_group", {})).replace(b"trajectory_group",
                                                                                   b"\x80rajectory_group")
    for check in (decode, summarize_group, record_id_of):
        with pytest.raises(DecodeError):
            check(frame)


def test_batches_splice_groups_whose_envelope_is_encoded_unusually():
    group = synthetic_group("odd", completion_tokens=3)
    canonical = encode(group)
    unusual = b"\x93\xcc" + canonical[1:2] + canonical[2:]  # schema version as a uint8 instead of a fixint
    assert decode(unusual) == group
    assert decode(encode_batch([unusual], [0], 1, 0, [])).groups == [group]
