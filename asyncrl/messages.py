"""Messages between the roles: plain dataclasses on a msgpack wire format (never pickle).

Every message travels in an envelope `[schema_version, kind, body]`. Decoding is typed (msgspec
validates each field against the dataclass annotations in C), so arbitrary bytes either yield a
well-formed message or raise `DecodeError`; nothing else escapes `decode`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import msgspec

SCHEMA_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a group of 16 × 32k-token samples fits comfortably


class DecodeError(ValueError):
    """Bytes that are not a valid asyncrl message (bad msgpack, unknown kind, wrong schema, too large)."""


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
        _DECODERS[kind] = msgspec.msgpack.Decoder(type=cls)
        return cls

    return register


# ----------------------------------------------------------------------------------------------
# Trajectories


@dataclass
class Trajectory:
    """One sampled completion with everything the learner needs to train on it."""

    prompt_ids: list[int]  # token ids of the prompt as the engine saw it
    completion_ids: list[int]  # token ids after the prompt (model and, in multi-turn, environment tokens)
    behaviour_logprobs: list[float]  # log π_behav(token) reported by the engine; 0.0 where loss_mask is 0
    token_versions: list[int]  # policy version that sampled each completion token (-1 for environment tokens)
    loss_mask: list[int]  # 1 = train on this token (model output), 0 = environment/tool token
    reward: float  # scalar reward used for advantages
    group_id: str  # samples of one prompt share it (group-relative advantages)
    data_source: str  # dataset the prompt came from; selects the scorer and per-source metrics
    finish_reason: str  # "stop", "length", "abort", "env_done", ...
    reward_info: dict[str, float] = field(default_factory=dict)  # extra numeric outputs of the scorer
    reward_error: str = ""  # non-empty when scoring failed (exception or timeout); reward is then 0
    num_turns: int = 1  # model turns in the episode (multi-turn)

    def validate(self) -> None:
        n = len(self.completion_ids)
        for name in ("behaviour_logprobs", "token_versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise DecodeError(f"trajectory {name} has {len(getattr(self, name))} entries, expected {n}")
        if not set(self.loss_mask) <= {0, 1}:
            raise DecodeError("trajectory loss_mask must hold only 0 and 1")

    def oldest_version(self) -> int:
        """The oldest policy version among trained tokens (-1 if none is trained)."""
        versions = [v for v, m in zip(self.token_versions, self.loss_mask) if m]
        return min(versions) if versions else -1


@message("trajectory_group")
@dataclass
class TrajectoryGroup:
    """All samples of one prompt, produced together and buffered, handed out and dropped together."""

    record_id: str  # idempotency key: a resend with the same id is acknowledged, not stored twice
    group_id: str  # shared by the trajectories; equals each trajectory's group_id
    server_id: str  # rollout server that produced it
    trajectories: list[Trajectory]  # the group's samples

    def validate(self) -> None:
        if not self.trajectories:
            raise DecodeError("trajectory group is empty")
        for trajectory in self.trajectories:
            trajectory.validate()
            if trajectory.group_id != self.group_id:
                raise DecodeError(f"trajectory group_id '{trajectory.group_id}' != group '{self.group_id}'")

    def oldest_version(self) -> int:
        return min(t.oldest_version() for t in self.trajectories)

    def num_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.completion_ids) for t in self.trajectories)


# ----------------------------------------------------------------------------------------------
# Control messages


@message("ack")
@dataclass
class Ack:
    record_id: str  # the acknowledged record
    offset: int  # position in the buffer's log (-1 when rejected)
    duplicate: bool = False  # the record was already in the log (a resend)
    error: str = ""  # non-empty when the record was rejected; the reason


@message("admission_request")
@dataclass
class AdmissionRequest:
    server_id: str  # asking rollout server
    wanted: int  # prompt groups it would like to start
    finished: int = 0  # groups it started earlier and has since sent or abandoned


@message("admission_grant")
@dataclass
class AdmissionGrant:
    granted: int  # prompt groups the server may start now
    policy_version: int  # learner version the grant was computed for


@message("batch_request")
@dataclass
class BatchRequest:
    consumer_id: str  # requesting learner
    policy_version: int  # learner version that will train on the batch (staleness reference)
    max_samples: int = 0  # samples wanted (0 = no limit by samples)
    max_tokens: int = 0  # tokens wanted (0 = no limit by tokens)
    timeout_ms: int = 0  # wait this long for enough data (0 = answer at once)


@message("batch")
@dataclass
class Batch:
    groups: list[TrajectoryGroup]  # whole groups, in log order
    offsets: list[int]  # log offset of each group
    next_offset: int  # offset to commit once the batch is trained on
    dropped_stale: int = 0  # groups skipped as too stale while assembling this batch


@message("commit")
@dataclass
class Commit:
    consumer_id: str  # committing learner
    offset: int  # everything before this offset has been trained on and checkpointed
    policy_version: int  # learner version at the commit


@message("policy_version")
@dataclass
class PolicyVersion:
    version: int  # optimizer steps completed by the learner
    weights_at: str = ""  # where servers that missed the last sync can fetch these weights (checkpoint dir)


@message("error")
@dataclass
class ErrorReply:
    error: str  # what went wrong with the request


# ----------------------------------------------------------------------------------------------
# Codec

_ENCODER = msgspec.msgpack.Encoder()
# msgspec reports malformed input as MsgspecError, invalid UTF-8 in a string as UnicodeDecodeError
# (a ValueError), and absurd nesting as RecursionError.
_UNDECODABLE = (msgspec.MsgspecError, ValueError, RecursionError)
_ENVELOPE = msgspec.msgpack.Decoder(type=tuple[int, str, msgspec.Raw])


def encode(msg: Any) -> bytes:
    """Serialise a registered message to msgpack bytes."""
    kind = getattr(type(msg), "kind", None)
    if kind not in _KINDS or not dataclasses.is_dataclass(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered asyncrl message")
    return _ENCODER.encode((SCHEMA_VERSION, kind, msg))


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, expect: type[_T] | None = None) -> Any:
    """Parse bytes into a message; raise DecodeError for anything that is not one."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise DecodeError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        version, kind, body = _ENVELOPE.decode(data)
    except _UNDECODABLE as error:
        raise DecodeError(f"not an asyncrl message: {error}") from None
    if version != SCHEMA_VERSION:
        raise DecodeError(f"schema version {version} is not supported (this build speaks {SCHEMA_VERSION})")
    if kind not in _DECODERS:
        raise DecodeError(f"unknown message kind '{kind}'")
    try:
        msg = _DECODERS[kind].decode(body)
    except _UNDECODABLE as error:
        raise DecodeError(f"malformed '{kind}' message: {error}") from None
    validate = getattr(msg, "validate", None)
    if validate is not None:
        validate()
    if expect is not None and not isinstance(msg, expect):
        raise DecodeError(f"expected a '{expect.kind}' message, got '{kind}'")  # type: ignore[attr-defined]
    return msg


def kinds() -> dict[str, type]:
    """Registered message kinds and their classes."""
    return dict(_KINDS)
