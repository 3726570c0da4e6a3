"""Codec: valid messages round-trip; arbitrary bytes give DecodeError and nothing else."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.messages import (
    SCHEMA_VERSION,
    Ack,
    AdmissionRequest,
    Batch,
    DecodeError,
    Trajectory,
    TrajectoryGroup,
    decode,
    encode,
)

ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)  # per-token ints travel as int32
floats = st.floats(allow_nan=False, width=64)
token_floats = st.floats(allow_nan=False, width=32)  # per-token floats travel as float32
text = st.text(max_size=20)


@st.composite
def trajectories(draw, group_id=None):
    n = draw(st.integers(min_value=0, max_value=40))
    return Trajectory(
        prompt_ids=draw(st.lists(ints, max_size=20)),
        completion_ids=draw(st.lists(ints, min_size=n, max_size=n)),
        behaviour_logprobs=draw(st.lists(token_floats, min_size=n, max_size=n)),
        token_versions=draw(st.lists(ints, min_size=n, max_size=n)),
        loss_mask=draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)),
        reward=draw(floats),
        group_id=group_id if group_id is not None else draw(text),
        data_source=draw(text),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        reward_info=draw(st.dictionaries(text, floats, max_size=3)),
        reward_error=draw(text),
        num_turns=draw(st.integers(min_value=1, max_value=10)),
    )


@st.composite
def groups(draw):
    group_id = draw(text)
    return TrajectoryGroup(
        record_id=draw(text),
        group_id=group_id,
        server_id=draw(text),
        trajectories=draw(st.lists(trajectories(group_id=group_id), min_size=1, max_size=4)),
    )


@settings(max_examples=200, deadline=None)
@given(groups())
def test_trajectory_group_round_trips(group):
    assert decode(encode(group)) == group


@settings(max_examples=100, deadline=None)
@given(st.lists(groups(), max_size=3), st.integers(min_value=0, max_value=10**12))
def test_batch_round_trips(batch_groups, next_offset):
    batch = Batch(groups=batch_groups, offsets=list(range(len(batch_groups))), next_offset=next_offset)
    assert decode(encode(batch)) == batch


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_decode_error(data):
    try:
        decode(data)
    except DecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(groups(), st.data())
def test_truncated_and_corrupted_messages_raise_decode_error(group, data):
    wire = bytearray(encode(group))
    cut = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
    with pytest.raises(DecodeError):
        decode(bytes(wire[:cut]))
    position = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
    wire[position] ^= data.draw(st.integers(min_value=1, max_value=255))
    try:
        decode(bytes(wire))
    except DecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | ints | floats | text | st.binary(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                    max_leaves=20))
def test_well_formed_msgpack_of_the_wrong_shape_raises_decode_error(obj):
    for wire in (msgpack.packb(obj), msgpack.packb([SCHEMA_VERSION, "trajectory_group", obj])):
        try:
            decode(wire)
        except DecodeError:
            pass


def test_specific_rejections():
    good = encode(Ack(record_id="r", offset=3))
    assert decode(good) == Ack(record_id="r", offset=3)
    with pytest.raises(DecodeError, match="schema version"):
        decode(msgpack.packb([SCHEMA_VERSION + 1, "ack", {"record_id": "r", "offset": 1}]))
    with pytest.raises(DecodeError, match="unknown message kind"):
        decode(msgpack.packb([SCHEMA_VERSION, "launch_missiles", {}]))
    with pytest.raises(DecodeError, match="exceeds the limit"):
        decode(good, max_bytes=len(good) - 1)
    with pytest.raises(DecodeError, match="expected a 'admission_request'"):
        decode(good, expect=AdmissionRequest)


def test_inconsistent_trajectory_lengths_are_rejected():
    bad = Trajectory([1], [5, 6], [-0.1], [0, 0], [1, 1], 1.0, "g", "arithmetic", "stop")
    with pytest.raises(DecodeError, match="behaviour_logprobs"):
        decode(encode(TrajectoryGroup("r", "g", "s", [bad])))
    other_group = Trajectory([1], [5], [-0.1], [0], [1], 1.0, "h", "arithmetic", "stop")
    with pytest.raises(DecodeError, match="group_id"):
        decode(encode(TrajectoryGroup("r", "g", "s", [other_group])))


def test_staleness_uses_oldest_trained_token_version():
    trajectory = Trajectory([1], [5, 6, 7], [-0.1, 0.0, -0.2], [4, 2, 5], [1, 0, 1], 1.0, "g", "a", "stop")
    assert trajectory.oldest_version() == 4  # the version-2 token is an environment token (mask 0)
