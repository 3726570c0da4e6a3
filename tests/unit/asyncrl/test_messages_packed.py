"""Per-token fields travel as packed little-endian arrays; bad arrays are rejected with a clear error."""

import msgspec
import numpy as np
import pytest

from buffer.group_summary import summarize_group
from asyncrl.messages import SCHEMA_VERSION, DecodeError, Trajectory, TrajectoryGroup, decode, encode
from asyncrl.packed import Float32List, Int32List, MaskList, pack


def trajectory(**changes) -> Trajectory:
    fields = dict(prompt_ids=[7, 2**31 - 1], completion_ids=[-(2**31), 5, 6], behaviour_logprobs=[-0.5, -1.25, 0.0],
                  token_versions=[3, 4, -1], loss_mask=[1, 1, 0], reward=1.0, group_id="g", data_source="src",
                  finish_reason="stop")
    fields.update(changes)
    return Trajectory(**fields)


def group_body(frame: bytes) -> dict:
    """The frame's body as plain msgpack objects, to tamper with."""
    return msgspec.msgpack.decode(frame)[2]


def reencode(body: dict) -> bytes:
    return msgspec.msgpack.encode((SCHEMA_VERSION, "trajectory_group", body))


def rejected_by_both(frame: bytes, *parts: str) -> None:
    """Both the learner's decode and the buffer's check refuse the frame, with every part in the message."""
    for check in (decode, summarize_group):
        with pytest.raises(DecodeError) as error:
            check(frame)
        assert all(part in str(error.value) for part in parts), str(error.value)


def test_packed_fields_round_trip_as_lists_and_go_on_the_wire_as_little_endian_bytes():
    group = TrajectoryGroup("r", "g", "s", [trajectory()])
    frame = encode(group)
    sent = group_body(frame)["trajectories"][0]
    assert sent["completion_ids"] == np.array([-(2**31), 5, 6], "<i4").tobytes()
    assert sent["behaviour_logprobs"] == np.array([-0.5, -1.25, 0.0], "<f4").tobytes()
    assert sent["loss_mask"] == b"\x01\x01\x00"
    received = decode(frame)
    assert received == group
    assert type(received.trajectories[0].completion_ids) is Int32List and isinstance(
        received.trajectories[0].completion_ids, list)
    assert summarize_group(frame).oldest_version == 3


def test_log_probs_travel_as_float32():
    received = decode(encode(TrajectoryGroup("r", "g", "s", [trajectory(behaviour_logprobs=[-0.1, -0.2, 0.0])])))
    assert received.trajectories[0].behaviour_logprobs == pytest.approx([-0.1, -0.2, 0.0], rel=1e-7)
    assert received.trajectories[0].behaviour_logprobs[0] == float(np.float32(-0.1))


def test_truncated_array_is_rejected_naming_the_field():
    body = group_body(encode(TrajectoryGroup("r", "g", "s", [trajectory()])))
    body["trajectories"][0]["token_versions"] = body["trajectories"][0]["token_versions"][:-1]
    rejected_by_both(reencode(body), "token_versions", "11 bytes is not a whole number of 4-byte items")


def test_array_of_the_wrong_length_is_rejected():
    body = group_body(encode(TrajectoryGroup("r", "g", "s", [trajectory()])))
    body["trajectories"][0]["behaviour_logprobs"] = pack([-0.5, -1.0], Float32List)
    rejected_by_both(reencode(body), "behaviour_logprobs has 2 entries, expected 3")


def test_a_list_where_a_packed_array_belongs_is_rejected():
    body = group_body(encode(TrajectoryGroup("r", "g", "s", [trajectory()])))
    body["trajectories"][0]["completion_ids"] = [4, 5, 6]  # schema-1 style msgpack list
    rejected_by_both(reencode(body), "completion_ids")
    with pytest.raises(DecodeError, match="expected a packed <i4 array"):
        decode(reencode(body))


def test_garbled_mask_is_rejected():
    body = group_body(encode(TrajectoryGroup("r", "g", "s", [trajectory()])))
    body["trajectories"][0]["loss_mask"] = b"\x01\x07\x00"
    rejected_by_both(reencode(body), "loss_mask", "values other than [0, 1]")


def test_schema_1_frames_are_refused_with_the_version_named():
    body = group_body(encode(TrajectoryGroup("r", "g", "s", [trajectory()])))
    with pytest.raises(DecodeError, match=f"schema version 1 is not supported .*speaks {SCHEMA_VERSION}"):
        decode(msgspec.msgpack.encode((1, "trajectory_group", body)))


@pytest.mark.parametrize("field, values, kind", [
    ("completion_ids", [2**31, 0, 0], Int32List),
    ("behaviour_logprobs", [1e300, 0.0, 0.0], Float32List),
    ("loss_mask", [1, 2, 0], MaskList),
])
def test_values_that_do_not_fit_their_wire_type_fail_at_encode(field, values, kind):
    with pytest.raises(ValueError, match=f"trajectory {field}"):
        encode(TrajectoryGroup("r", "g", "s", [trajectory(**{field: values})]))
    with pytest.raises(ValueError):
        pack(values, kind)
