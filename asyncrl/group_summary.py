"""A cheaper check of an encoded TrajectoryGroup for the buffer's ingest path.

`messages.decode` parses the envelope, then the body again, and turns every per-token array into a
list. `summarize_group` decodes both in one typed pass into twins of the message dataclasses whose
per-token fields are left as the received bytes, then runs the same checks on them (packed-array
checks, `validate`) over numpy views. So it accepts exactly the frames `decode` accepts as a
TrajectoryGroup, and returns only what the buffer needs to store, deduplicate, size and judge the
staleness of a record.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncrl.messages import DECODE_FAILURES, SCHEMA_VERSION, DecodeError, Trajectory, TrajectoryGroup
from asyncrl.packed import PackedList, checked_array


@dataclass(frozen=True)
class GroupSummary:
    record_id: str  # idempotency key of the record
    server_id: str  # producing rollout server
    num_samples: int  # trajectories in the group
    num_tokens: int  # prompt + completion tokens over the group
    oldest_version: int  # oldest trained token version (-1 if none is trained)


def _twin(cls: type, name: str, replaced: dict[str, Any]) -> type:
    """A msgspec Struct with the fields, types and defaults of dataclass `cls`, some types replaced."""
    hints = typing.get_type_hints(cls)
    fields: list[tuple] = []
    for f in dataclasses.fields(cls):
        annotation = replaced.get(f.name, hints[f.name])
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, annotation, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, annotation, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, annotation))
    return msgspec.defstruct(name, fields)


_PACKED = {name: hint for name, hint in typing.get_type_hints(Trajectory).items()
           if isinstance(hint, type) and issubclass(hint, PackedList)}
_RawTrajectory = _twin(Trajectory, "_RawTrajectory", dict.fromkeys(_PACKED, bytes))
_RawGroup = _twin(TrajectoryGroup, "_RawGroup", {"trajectories": list[_RawTrajectory]})
_GROUP_FRAME = msgspec.msgpack.Decoder(type=tuple[int, str, _RawGroup])


def summarize_group(frame: bytes) -> GroupSummary:
    """Check that `frame` is a valid TrajectoryGroup message and summarise it; raise DecodeError if not.

    The caller enforces the size limit first, as `decode` does."""
    try:
        version, kind, raw = _GROUP_FRAME.decode(frame)
    except DECODE_FAILURES as error:
        raise DecodeError(f"not a trajectory group message: {error}") from None
    if version != SCHEMA_VERSION or kind != TrajectoryGroup.kind:  # type: ignore[attr-defined]
        raise DecodeError(f"not a trajectory group message: schema {version}, kind '{kind}'")
    group = TrajectoryGroup(raw.record_id, raw.group_id, raw.server_id,
                            [_with_arrays(index, trajectory) for index, trajectory in enumerate(raw.trajectories)])
    group.validate()
    return GroupSummary(
        record_id=group.record_id,
        server_id=group.server_id,
        num_samples=group.num_samples(),
        num_tokens=group.num_tokens(),
        oldest_version=group.oldest_version(),
    )


def _with_arrays(index: int, raw: Any) -> Trajectory:
    """The trajectory with its per-token fields as checked numpy views of the received bytes."""
    fields = msgspec.structs.asdict(raw)
    for name, kind in _PACKED.items():
        try:
            fields[name] = checked_array(fields[name], kind)
        except (TypeError, ValueError) as error:
            raise DecodeError(f"not a valid trajectory group: {error} - at `trajectories[{index}].{name}`") from None
    return Trajectory(**fields)


class _RecordHead(msgspec.Struct):
    record_id: str


_RECORD_HEAD = msgspec.msgpack.Decoder(type=tuple[int, str, _RecordHead])


def record_id_of(frame: bytes) -> str:
    """The record id of an encoded TrajectoryGroup, skipping the rest (for rebuilding an id index)."""
    try:
        return _RECORD_HEAD.decode(frame)[2].record_id
    except DECODE_FAILURES as error:
        raise DecodeError(f"no record id in frame: {error}") from None
