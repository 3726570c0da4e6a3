"""The control channel's messages on the wire: each round-trips in the versioned envelope, and bytes that are not
one of them (garbage, another schema version, a kind no build of this one sends, out-of-range ids and numbers from
a server) raise a DecodeError that says what is wrong."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.messages import SCHEMA_VERSION, DecodeError, decode, encode
from asyncrl.weight_transfer.control_messages import (JobFinished, ServerHeartbeat, ServerLeaving, ServerTelemetry,
                                                      SyncDone, SyncInvite, SyncPrepare, SyncReady, TaskWeights,
                                                      ValidateVersion, ValidationResult)
from asyncrl.wire_limits import MAX_ID_CHARS

EVERY_KIND = [
    ServerHeartbeat("server-0", ranks=2, version=7, needs_catch_up=True),
    ServerLeaving("server-0"),
    SyncPrepare(round_id=3),
    SyncReady("server-0", round_id=3),
    SyncInvite(round_id=3, version=8, update_info={"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]},
               init_info={"host": "127.0.0.1", "port": 29500}),
    SyncDone("server-0", round_id=3, ok=False, seconds=0.5, error="receive timed out"),
    ServerTelemetry("server-0", version=8, tokens_generated=123, idle_seconds=1.5, chat_lost=2),
    ValidationResult("server-0", version=8, metrics={"val/score/mean": 0.25}),
    ValidateVersion(version=8),
    TaskWeights(version=8, weights=[0.25, 0.75]),
    JobFinished(version=8),
]


@pytest.mark.parametrize("sent", EVERY_KIND, ids=lambda sent: sent.kind)
def test_every_control_message_round_trips_in_the_versioned_envelope(sent):
    wire = encode(sent)
    version, kind, _ = msgpack.unpackb(wire)
    assert (version, kind) == (SCHEMA_VERSION, sent.kind)
    assert decode(wire) == sent


def test_each_message_has_a_kind_of_its_own():
    assert len({sent.kind for sent in EVERY_KIND}) == len(EVERY_KIND)


@pytest.mark.parametrize(("body", "error"), [
    ({"server_id": "s", "ranks": 0, "version": 1}, r"Expected `int` >= 1 - at `\$.ranks`"),
    ({"server_id": "s", "ranks": 1, "version": -1}, r"Expected `int` >= 0 - at `\$.version`"),
    ({"server_id": "x" * (MAX_ID_CHARS + 1), "ranks": 1, "version": 1},
     r"Expected `str` of length <= 256 - at `\$.server_id`"),
    ({"server_id": "s", "ranks": "two", "version": 1}, r"Expected `int`, got `str` - at `\$.ranks`"),
])
def test_a_heartbeat_out_of_range_is_refused_naming_the_field(body, error):
    with pytest.raises(DecodeError, match=r"malformed 'server_heartbeat' message: " + error):
        decode(msgpack.packb([SCHEMA_VERSION, "server_heartbeat", body]))


def test_what_no_peer_of_this_build_sends_is_refused_clearly():
    with pytest.raises(DecodeError, match="unknown message kind 'sync_join'"):  # an older build's heartbeat
        decode(msgpack.packb([SCHEMA_VERSION, "sync_join", {"server_id": "s", "ranks": 1, "version": 0}]))
    with pytest.raises(DecodeError, match=f"schema version {SCHEMA_VERSION + 1} is not supported"):
        decode(msgpack.packb([SCHEMA_VERSION + 1, "validation_result", {"server_id": "s", "version": 1,
                                                                         "metrics": {}}]))
    with pytest.raises(DecodeError, match="malformed 'validation_result' message"):
        decode(msgpack.packb([SCHEMA_VERSION, "validation_result", {"server_id": "s", "version": 1,
                                                                     "metrics": {"val/score/mean": "high"}}]))


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from([sent.kind for sent in EVERY_KIND]),
       body=st.recursive(
           st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
           max_leaves=12))
def test_any_body_of_a_control_kind_decodes_or_raises_decode_error(kind, body):
    try:
        decode(msgpack.packb([SCHEMA_VERSION, kind, body]))
    except DecodeError:
        pass
