"""A cheaper check of an encoded TrajectoryGroup for the buffer's ingest path.

`messages.decode` parses the envelope, then the body again. `summarize_group` decodes both in one
typed pass (same dataclass, same `validate`), so it accepts exactly the frames `decode` accepts as a
TrajectoryGroup, and returns only what the buffer needs to store, deduplicate, size and judge the
staleness of a record.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from asyncrl.messages import DECODE_FAILURES, SCHEMA_VERSION, DecodeError, TrajectoryGroup

_GROUP_FRAME = msgspec.msgpack.Decoder(type=tuple[int, str, TrajectoryGroup])


@dataclass(frozen=True)
class GroupSummary:
    record_id: str  # idempotency key of the record
    server_id: str  # producing rollout server
    num_samples: int  # trajectories in the group
    num_tokens: int  # prompt + completion tokens over the group
    oldest_version: int  # oldest trained token version (-1 if none is trained)


def summarize_group(frame: bytes) -> GroupSummary:
    """Check that `frame` is a valid TrajectoryGroup message and summarise it; raise DecodeError if not.

    The caller enforces the size limit first, as `decode` does."""
    try:
        version, kind, group = _GROUP_FRAME.decode(frame)
    except DECODE_FAILURES as error:
        raise DecodeError(f"not a trajectory group message: {error}") from None
    if version != SCHEMA_VERSION or kind != TrajectoryGroup.kind:  # type: ignore[attr-defined]
        raise DecodeError(f"not a trajectory group message: schema {version}, kind '{kind}'")
    group.validate()
    return GroupSummary(
        record_id=group.record_id,
        server_id=group.server_id,
        num_samples=group.num_samples(),
        num_tokens=group.num_tokens(),
        oldest_version=group.oldest_version(),
    )


class _RecordHead(msgspec.Struct):
    record_id: str


_RECORD_HEAD = msgspec.msgpack.Decoder(type=tuple[int, str, _RecordHead])


def record_id_of(frame: bytes) -> str:
    """The record id of an encoded TrajectoryGroup, skipping the rest (for rebuilding an id index)."""
    try:
        return _RECORD_HEAD.decode(frame)[2].record_id
    except DECODE_FAILURES as error:
        raise DecodeError(f"no record id in frame: {error}") from None
