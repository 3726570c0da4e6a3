"""A cheaper check of an encoded TrajectoryGroup for the buffer's ingest path.

`messages.decode` parses the envelope, then the body again, and turns every per-token array into a
list. `summarize_group` decodes both in one typed pass into twins of the message dataclasses whose
per-token fields stay views of the received bytes (no copies), then checks their lengths and mask values with a few
comparisons per trajectory (falling back to the same checks `decode` makes, for their precise error,
when one fails) and judges staleness over numpy views of the whole group's versions and masks at
once. So it accepts exactly the frames `decode` accepts as a TrajectoryGroup, and returns only what
the buffer needs to store, deduplicate, size, count and judge the start of a record.
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from asyncrl.messages import (DECODE_FAILURES, PACKED_FIELDS, PER_TOKEN_FIELDS, SCHEMA_VERSION, DecodeError,
                              Trajectory, TrajectoryGroup, check_group_ids, check_token_counts, oldest_trained_version)
from asyncrl.packed import Float32List, Int32List, MaskList, packed_count


@dataclass(frozen=True)
class GroupSummary:
    record_id: str  # idempotency key of the record
    server_id: str  # producing rollout server
    num_samples: int  # trajectories in the group
    num_tokens: int  # prompt + completion tokens over the group
    response_tokens: int  # trained completion tokens (loss mask 1) over the group
    oldest_version: int  # oldest trained token version, the version the group started under (-1 if none is trained)
    learner_version_at_start: int  # learner version when the group started (-1: unknown)
    token_versions: tuple[int, int] = (0, 0)  # lowest and highest version of any token, whatever its mask ((0, 0): no token)


def _twin(cls: type, name: str, replaced: dict[str, Any]) -> type:
    """A msgspec Struct with the fields, types and defaults of dataclass `cls`, some types replaced."""
    hints = typing.get_type_hints(cls, include_extras=True)  # range checks (msgspec.Meta) included
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


_RawTrajectory = _twin(Trajectory, "_RawTrajectory", dict.fromkeys(PACKED_FIELDS, memoryview))
_RawGroup = _twin(TrajectoryGroup, "_RawGroup", {"trajectories": list[_RawTrajectory]})
_GROUP_FRAME = msgspec.msgpack.Decoder(type=tuple[int, str, _RawGroup])
assert set(PER_TOKEN_FIELDS) < set(PACKED_FIELDS)
assert [PACKED_FIELDS[name] for name in ("prompt_ids", "completion_ids", *PER_TOKEN_FIELDS)] == [
    Int32List, Int32List, Float32List, Int32List, MaskList], "update _well_formed to the Trajectory fields"
_ID_BYTES, _LOGPROB_BYTES, _MASK_BYTES = (kind.dtype.itemsize for kind in (Int32List, Float32List, MaskList))
_MASK_MAX = max(MaskList.allowed)  # one numpy max checks every mask byte: the allowed values are 0..max
assert MaskList.allowed == bytes(range(_MASK_MAX + 1))
_PROMPT_IDS, _COMPLETION_IDS = operator.attrgetter("prompt_ids"), operator.attrgetter("completion_ids")


def summarize_group(frame: bytes | memoryview) -> GroupSummary:
    """Check that `frame` is a valid TrajectoryGroup message and summarise it; raise DecodeError if not.

    The caller enforces the size limit first, as `decode` does."""
    try:
        version, kind, group = _GROUP_FRAME.decode(frame)
    except DECODE_FAILURES as error:
        raise DecodeError(f"not a trajectory group message: {error}") from None
    if version != SCHEMA_VERSION or kind != TrajectoryGroup.kind:  # type: ignore[attr-defined]
        raise DecodeError(f"not a trajectory group message: schema {version}, kind '{kind}'")
    trajectories = group.trajectories
    check_group_ids(group.group_id, [trajectory.group_id for trajectory in trajectories])
    masks = np.frombuffer(b"".join(trajectory.loss_mask for trajectory in trajectories), MaskList.dtype)
    if not all(map(_well_formed, trajectories)) or (masks.size and masks.max() > _MASK_MAX):
        for index, trajectory in enumerate(trajectories):  # find the problem, say it as decode would
            check_token_counts(_token_counts(index, trajectory))
    versions = np.frombuffer(b"".join(trajectory.token_versions for trajectory in trajectories), Int32List.dtype)
    id_bytes = sum(map(len, map(_PROMPT_IDS, trajectories))) + sum(map(len, map(_COMPLETION_IDS, trajectories)))
    return GroupSummary(
        record_id=group.record_id,
        server_id=group.server_id,
        num_samples=len(trajectories),
        num_tokens=id_bytes // _ID_BYTES,
        response_tokens=int(masks.sum()),
        oldest_version=oldest_trained_version(versions, masks),
        learner_version_at_start=group.learner_version_at_start,
        token_versions=(int(versions.min()), int(versions.max())) if versions.size else (0, 0),
    )


def _well_formed(trajectory: Any) -> bool:
    """Whole items in every packed field, one per completion token in the per-token ones (the fast path)."""
    tokens, partial = divmod(len(trajectory.completion_ids), _ID_BYTES)
    return not (partial or len(trajectory.prompt_ids) % _ID_BYTES
                or len(trajectory.behaviour_logprobs) != tokens * _LOGPROB_BYTES
                or len(trajectory.token_versions) != tokens * _ID_BYTES
                or len(trajectory.loss_mask) != tokens * _MASK_BYTES)


def _token_counts(index: int, trajectory: Any) -> dict[str, int]:
    """Entries in each packed field of a received trajectory, after the checks `decode` makes."""
    counts = {}
    for name, kind in PACKED_FIELDS.items():
        try:
            counts[name] = packed_count(getattr(trajectory, name), kind)
        except (TypeError, ValueError) as error:
            raise DecodeError(f"not a valid trajectory group: {error} - at `trajectories[{index}].{name}`") from None
    return counts


class _RecordHead(msgspec.Struct):
    record_id: str


_RECORD_HEAD = msgspec.msgpack.Decoder(type=tuple[int, str, _RecordHead])


def record_id_of(frame: bytes) -> str:
    """The record id of an encoded TrajectoryGroup, skipping the rest (for rebuilding an id index)."""
    try:
        return _RECORD_HEAD.decode(frame)[2].record_id
    except DECODE_FAILURES as error:
        raise DecodeError(f"no record id in frame: {error}") from None
