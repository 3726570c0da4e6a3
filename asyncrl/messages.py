"""Messages between the roles: plain dataclasses on a msgpack wire format (never pickle).

Every message travels in an envelope `[schema_version, kind, body]`. Decoding is typed (msgspec
validates each field against the dataclass annotations in C), so arbitrary bytes either yield a
well-formed message or raise `DecodeError`; nothing else escapes `decode`. A trajectory's per-token
fields travel as packed little-endian arrays (see asyncrl.packed) and are Python lists in memory.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Mapping, Sequence, TypeVar

import msgspec
import numpy as np

from asyncrl.packed import Float32List, Int32List, MaskList, PackedList, as_lists, pack
from asyncrl.wire_limits import MAX_AHEAD, MAX_COUNT, MAX_ID_CHARS, MAX_OFFSET, MAX_PATH_CHARS, MAX_VERSION, MAX_WAIT_MS

SCHEMA_VERSION = 2  # 2: per-token fields as packed arrays (1 had msgpack lists of numbers)
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a group of 16 × 32k-token samples fits comfortably


BUFFERS_OWN_STALENESS = -1  # a batch request that names no K: the buffer keeps the one it applies

Version = Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)]
Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_OFFSET)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Identifier = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
Ahead = Annotated[list[Offset], msgspec.Meta(max_length=MAX_AHEAD)]


class DecodeError(ValueError):
    """Bytes that are not a valid asyncrl message (bad msgpack, unknown kind, wrong schema, too large)."""


# What msgspec raises on bad bytes; invalid UTF-8 in a string surfaces as UnicodeDecodeError, not MsgspecError.
DECODE_FAILURES = (msgspec.MsgspecError, RecursionError, UnicodeDecodeError)

_T = TypeVar("_T")
_KINDS: dict[str, type] = {}
_DECODERS: dict[str, msgspec.msgpack.Decoder] = {}


def message(kind: str) -> Callable[[type[_T]], type[_T]]:
    """Register a dataclass as a message of the given kind."""

    def register(cls: type[_T]) -> type[_T]:
        if kind in _KINDS:
            raise ValueError(f"message kind '{kind}' registered twice")
        cls.kind = kind  # type: ignore[attr-defined]
        _KINDS[kind] = cls
        _DECODERS[kind] = msgspec.msgpack.Decoder(type=cls, dec_hook=as_lists)
        return cls

    return register


# ----------------------------------------------------------------------------------------------
# Trajectories

PER_TOKEN_FIELDS = ("behaviour_logprobs", "token_versions", "loss_mask")  # one entry per completion token


def check_token_counts(counts: Mapping[str, int]) -> None:
    """A trajectory's per-token fields (entry counts by field name) match its completion_ids."""
    n = counts["completion_ids"]
    for name in PER_TOKEN_FIELDS:
        if counts[name] != n:
            raise DecodeError(f"trajectory {name} has {counts[name]} entries, expected {n}")


def check_group_ids(group_id: str, trajectory_group_ids: Sequence[str]) -> None:
    """A group holds at least one trajectory, all with the group's id."""
    if not trajectory_group_ids:
        raise DecodeError("trajectory group is empty")
    for other in trajectory_group_ids:
        if other != group_id:
            raise DecodeError(f"trajectory group_id '{other}' != group '{group_id}'")


def oldest_trained_version(token_versions: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray) -> int:
    """The oldest policy version among trained tokens (mask 1, version >= 0); -1 if there is none.

    A sample without trained tokens (e.g. an empty aborted completion) has no staleness."""
    versions, trained = np.asarray(token_versions), np.asarray(loss_mask)
    if not trained.all():
        versions = versions[trained.astype(bool)]
    oldest = int(versions.min()) if versions.size else -1
    if oldest < 0 and versions.size:  # unversioned tokens (-1) among the trained ones: only versioned ones count
        versioned = versions[versions >= 0]
        oldest = int(versioned.min()) if versioned.size else -1
    return oldest


@dataclass
class Trajectory:
    """One sampled completion with everything the learner needs to train on it."""

    prompt_ids: Int32List  # token ids of the prompt as the engine saw it
    completion_ids: Int32List  # token ids after the prompt (model and, in multi-turn, environment tokens)
    behaviour_logprobs: Float32List  # log π_behav(token) reported by the engine (float32); 0.0 where loss_mask is 0
    token_versions: Int32List  # policy version that sampled each completion token (environment tokens: that of the model token before them)
    loss_mask: MaskList  # 1 = train on this token (model output), 0 = environment/tool token or masked thinking (rollout.thinking)
    reward: float  # scalar reward used for advantages
    group_id: str  # samples of one prompt share it (group-relative advantages)
    data_source: str  # dataset the prompt came from; selects the scorer and per-source metrics
    finish_reason: str  # "stop", "length", "abort", "env_done", ...
    reward_info: dict[str, float] = field(default_factory=dict)  # extra numeric outputs of the scorer
    reward_error: str = ""  # non-empty when scoring failed (exception or timeout); reward is then 0
    num_turns: int = 1  # model turns in the episode (multi-turn)

    def validate(self) -> None:
        """Per-token fields agree in length (their types and mask values were checked while decoding)."""
        check_token_counts({name: len(getattr(self, name)) for name in ("completion_ids", *PER_TOKEN_FIELDS)})

    def oldest_version(self) -> int:
        """The oldest policy version among trained tokens (-1 if none is trained)."""
        return oldest_trained_version(self.token_versions, self.loss_mask)

    def packed(self) -> Trajectory:
        """A copy whose per-token fields are packed bytes, as they go on the wire."""
        return dataclasses.replace(self, **{name: self._pack(name, kind) for name, kind in PACKED_FIELDS.items()})

    def _pack(self, name: str, kind: type[PackedList]) -> bytes:
        try:
            return pack(getattr(self, name), kind)
        except ValueError as error:
            raise ValueError(f"trajectory {name}: {error}") from None


# Trajectory fields that travel packed, with their list types (which name the wire dtype).
PACKED_FIELDS: dict[str, type[PackedList]] = {name: hint for name, hint in typing.get_type_hints(Trajectory).items()
                                              if isinstance(hint, type) and issubclass(hint, PackedList)}


@message("trajectory_group")
@dataclass
class TrajectoryGroup:
    """All samples of one prompt, produced together and buffered, handed out and dropped together."""

    record_id: str  # idempotency key: a resend with the same id is acknowledged, not stored twice
    group_id: str  # shared by the trajectories; equals each trajectory's group_id
    server_id: str  # rollout server that produced it
    trajectories: list[Trajectory]  # the group's samples
    learner_version_at_start: Annotated[int, msgspec.Meta(ge=-1, le=MAX_VERSION)] = -1  # learner version when the group started: the server's last admission answer, or its first token's version where newer (-1: not started under one, e.g. a chat session)

    def validate(self) -> None:
        check_group_ids(self.group_id, [trajectory.group_id for trajectory in self.trajectories])
        for trajectory in self.trajectories:
            trajectory.validate()

    def oldest_version(self) -> int:
        """The oldest policy version among the group's trained tokens (-1 if none is trained).

        A sample without trained tokens (e.g. an empty aborted completion) has no staleness, so it
        does not make the whole group look as old as version -1."""
        versions = np.concatenate([np.asarray(t.token_versions, np.int64) for t in self.trajectories])
        trained = np.concatenate([np.asarray(t.loss_mask, np.uint8) for t in self.trajectories])
        return oldest_trained_version(versions, trained)

    def start_version(self) -> int:
        """The version of the group's first sampled token, whatever the loss mask says of it (-1 when none has one)."""
        versions = np.concatenate([np.asarray(t.token_versions, np.int64) for t in self.trajectories])  # [tokens]
        versioned = versions[versions >= 0]
        return int(versioned.min()) if versioned.size else -1

    def num_samples(self) -> int:
        return len(self.trajectories)

    def num_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.completion_ids) for t in self.trajectories)

    def packed(self) -> TrajectoryGroup:
        """A copy as it goes on the wire (see Trajectory.packed)."""
        return dataclasses.replace(self, trajectories=[trajectory.packed() for trajectory in self.trajectories])


# ----------------------------------------------------------------------------------------------
# Control messages


@message("ack")
@dataclass
class Ack:
    record_id: str  # the acknowledged record
    offset: int  # position in the buffer's log (-1 when rejected)
    duplicate: bool = False  # the record was already in the log (a resend)
    error: str = ""  # non-empty when the record was rejected; the reason
    retry_after_ms: int = 0  # > 0: not stored because the buffer is full; resend the same record after this wait


@message("admission_request")
@dataclass
class AdmissionRequest:
    server_id: Identifier  # asking rollout server
    wanted: Count  # prompt groups it would like to start
    finished: Count = 0  # groups it started earlier and has since sent or abandoned
    request_id: Identifier = ""  # unique per request; a resend repeats it and gets the first answer ("" = never repeated)
    running: Annotated[int, msgspec.Meta(ge=-1, le=MAX_COUNT)] = -1  # groups started, not finished, `finished` deducted (-1 = not reported)


@message("admission_grant")
@dataclass
class AdmissionGrant:
    granted: int  # prompt groups the server may start now
    policy_version: int  # learner version the grant was computed for
    max_staleness: int  # K the grant was computed with (the learner's, which may change during a run)


@message("batch_request")
@dataclass
class BatchRequest:
    consumer_id: Identifier  # requesting learner
    policy_version: Version  # learner version that will train on the batch (staleness reference)
    max_samples: Count = 0  # samples wanted (0 = no limit by samples)
    max_tokens: Count = 0  # tokens wanted (0 = no limit by tokens)
    timeout_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_WAIT_MS)] = 0  # wait this long for enough data (0 = answer at once)
    from_offset: Annotated[int, msgspec.Meta(ge=-1, le=MAX_OFFSET)] = -1  # consumer's position; -1 = the buffer's read cursor
    from_ahead: Ahead = field(default_factory=list)  # records at or past from_offset it has consumed too (last next_ahead)
    max_staleness: Annotated[int, msgspec.Meta(ge=BUFFERS_OWN_STALENESS, le=MAX_VERSION)] = BUFFERS_OWN_STALENESS  # the learner's K from now on (admission and selection follow it)

    def validate(self) -> None:
        if self.from_offset < 0 and self.from_ahead:
            raise DecodeError("batch request: from_ahead must be empty when from_offset is -1 (no position)")


@message("batch")
@dataclass
class Batch:
    groups: list[TrajectoryGroup]  # whole groups, in log order
    offsets: list[int]  # log offset of each group
    next_offset: int  # offset to commit once the batch is trained on: every record before it is consumed
    dropped_stale: int = 0  # groups dropped while assembling this batch: they started outside the staleness bound
    next_ahead: list[int] = field(default_factory=list)  # records at or past next_offset consumed too; committed with it


@message("commit")
@dataclass
class Commit:
    consumer_id: Identifier  # committing learner
    offset: Offset  # everything before this offset has been trained on and checkpointed
    policy_version: Version  # learner version at the commit
    ahead: Ahead = field(default_factory=list)  # records at or past `offset` trained on (or dropped) too


@message("policy_version")
@dataclass
class PolicyVersion:
    version: Version  # optimizer steps completed by the learner
    weights_at: Annotated[str, msgspec.Meta(max_length=MAX_PATH_CHARS)] = ""  # where servers that missed the last sync can fetch these weights (checkpoint dir)


@message("buffer_position")
@dataclass
class BufferPosition:
    """The buffer's offsets; the reply to Commit and PolicyVersion."""

    read_offset: int  # next offset the buffer will hand out
    committed_offset: int  # everything before it is trained on and checkpointed (durable in the buffer dir)
    end_offset: int  # offset the next appended record will get
    policy_version: int  # newest learner version the buffer has heard of


@message("stats_request")
@dataclass
class StatsRequest:
    requester: Identifier = ""  # who asks (for the buffer's log)


@message("buffer_stats")
@dataclass
class BufferStats:
    """The buffer's metrics; `metrics()` names them as the learner logs them (`buffer/...`)."""

    size: int  # groups stored and not yet handed out
    size_bytes: int  # bytes of those groups (held in memory)
    log_bytes: int  # bytes of segment files on disk
    read_offset: int  # next offset to hand out
    committed_offset: int  # last committed offset
    end_offset: int  # next offset to append
    policy_version: int  # newest learner version heard of
    ingested: int  # groups appended since the service started
    duplicates: int  # resends acknowledged without being stored again
    ingest_groups_per_s: float  # append rate over the last stats window
    ingest_bytes_per_s: float  # append rate over the last stats window, in bytes
    handed_out: int  # groups handed out in batches since the service started
    dropped_stale: int  # groups dropped at read time because they started from weights more than max_staleness behind the learner
    staleness_histogram: dict[int, int]  # staleness → groups handed out with it
    rejected_frames: int  # frames rejected as undecodable or over the size limit
    full_rejections: int  # ingests answered "retry later" because a memory or disk budget was full
    admission_running: int  # groups admitted and not yet reported finished, all servers together
    admission_waits: int  # admission requests granted fewer groups than wanted
    admission_wait_s: float  # time servers spent granted less than they wanted, summed over servers
    admission_released: int  # admitted groups released because their server stopped asking (timeout)
    read_ahead: list[int] = field(default_factory=list)  # records at or past read_offset already handed out or dropped
    refused_requests: int = 0  # well-formed requests refused (a bad position, a client over its caps)
    refused_over_caps: int = 0  # of those, refused by a cap (parked requests per client, wait, admission leases)
    unparked: int = 0  # batch requests answered at once instead of waiting: the total parking caps were full
    parked: int = 0  # batch requests waiting for data now
    admission_leases: int = 0  # servers holding an admission lease now
    consumers: int = 0  # consumers (client ids) holding a read position of their own now
    position_rereads: int = 0  # pending records read back from the log because a consumer moved its position
    max_staleness: int = 0  # K the buffer applies now (the learner's latest)
    ingested_samples: int = 0  # samples of the groups appended since the service started
    ingested_response_tokens: int = 0  # their trained completion tokens (loss mask 1): the servers' generated training work
    handed_out_samples: int = 0  # samples of the groups handed out since the service started
    handed_out_response_tokens: int = 0  # their trained completion tokens
    dropped_stale_response_tokens: int = 0  # trained completion tokens of the groups dropped stale: work thrown away
    first_generated_samples: int = 0  # the first whole groups stored in hand-out order (oldest start first) holding as many samples as were handed out
    first_generated_response_tokens: int = 0  # their trained completion tokens

    def metrics(self) -> dict[str, float]:
        """Flat metrics for wandb/metrics.jsonl."""
        flat = {f"buffer/{name}": float(value) for name, value in dataclasses.asdict(self).items()
                if name not in ("staleness_histogram", "read_ahead")}
        flat.update({f"buffer/staleness_{s}": float(n) for s, n in sorted(self.staleness_histogram.items())})
        return flat


@message("error")
@dataclass
class ErrorReply:
    error: str  # what went wrong with the request


# ----------------------------------------------------------------------------------------------
# Codec

_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(type=tuple[int, str, msgspec.Raw])
_GROUP_KIND: str = TrajectoryGroup.kind  # type: ignore[attr-defined]
_GROUP_PREFIX = _ENCODER.encode((SCHEMA_VERSION, _GROUP_KIND, None))[:-1]  # envelope up to the body (minus nil)


def encode(msg: Any) -> bytes:
    """Serialise a registered message to msgpack bytes."""
    kind = getattr(type(msg), "kind", None)
    if kind not in _KINDS or not dataclasses.is_dataclass(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered asyncrl message")
    return _ENCODER.encode((SCHEMA_VERSION, kind, _for_wire(msg)))


def _for_wire(msg: Any) -> Any:
    """The message with its trajectories' per-token fields packed (groups spliced in as Raw stay as they are)."""
    if isinstance(msg, TrajectoryGroup):
        return msg.packed()
    if isinstance(msg, Batch):
        return dataclasses.replace(msg, groups=[g if isinstance(g, msgspec.Raw) else g.packed() for g in msg.groups])
    return msg


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, expect: type[_T] | None = None) -> Any:
    """Parse bytes into a message; raise DecodeError for anything that is not one."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise DecodeError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        version, kind, body = _ENVELOPE.decode(data)
    except DECODE_FAILURES as error:
        raise DecodeError(f"not an asyncrl message: {error}") from None
    if version != SCHEMA_VERSION:
        raise DecodeError(f"schema version {version} is not supported (this build speaks {SCHEMA_VERSION})")
    if kind not in _DECODERS:
        raise DecodeError(f"unknown message kind '{kind}'")
    try:
        msg = _DECODERS[kind].decode(body)
    except DECODE_FAILURES as error:
        raise DecodeError(f"malformed '{kind}' message: {error}") from None
    validate = getattr(msg, "validate", None)
    if validate is not None:
        validate()
    if expect is not None and not isinstance(msg, expect):
        raise DecodeError(f"expected a '{expect.kind}' message, got '{kind}'")  # type: ignore[attr-defined]
    return msg


def group_body(frame: bytes | memoryview) -> msgspec.Raw:
    """The encoded TrajectoryGroup inside an envelope, without decoding or copying it (for re-embedding)."""
    view = memoryview(frame)
    if view[:len(_GROUP_PREFIX)] == _GROUP_PREFIX:
        return msgspec.Raw(view[len(_GROUP_PREFIX):])
    return _ENVELOPE.decode(frame)[2]


def encode_batch(group_frames: Sequence[bytes | memoryview], offsets: list[int], next_offset: int, dropped_stale: int,
                 next_ahead: list[int]) -> bytes:
    """Encode a Batch from already-encoded TrajectoryGroup messages, splicing their bytes in as they are."""
    raw_groups: Any = [group_body(frame) for frame in group_frames]
    return encode(Batch(groups=raw_groups, offsets=offsets, next_offset=next_offset, dropped_stale=dropped_stale,
                        next_ahead=next_ahead))


def kinds() -> dict[str, type]:
    """Registered message kinds and their classes."""
    return dict(_KINDS)
