"""Messages of the control channel between the learner's coordinator and the rollout servers, one purpose each.

They travel in the envelope of `asyncrl.messages` (schema version, kind, body): bytes that are not one of them
decode to a `DecodeError` that names what is wrong, and the numbers and ids a server sends are range-checked while
decoding, as the buffer's requests are.

- membership: `ServerHeartbeat` (server → learner, periodic), `ServerLeaving` (its answer to `JobFinished`);
- a weight-sync round: `SyncPrepare` → `SyncReady`, then `SyncInvite` → `SyncDone`;
- measurements: `ServerTelemetry` (a server's counters, periodic), `ValidationResult` (each of its latest validation passes);
- requests of the learner: `ValidateVersion`, `TaskWeights`, `JobFinished`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from asyncrl.messages import Count, Identifier, Version, message
from asyncrl.wire_limits import MAX_COUNT

Ranks = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]  # a server's group ranks: one per tensor-parallel worker


# ----------------------------------------------------------------------------------------------
# Membership


@message("server_heartbeat")
@dataclass
class ServerHeartbeat:
    """A server is there, every `rollout.weight_sync.heartbeat_s`; missing heartbeats drop it from rounds."""

    server_id: Identifier  # stable name of the rollout server
    ranks: Ranks  # group ranks the server needs (its tensor-parallel workers)
    version: Version  # policy version its engine holds now
    needs_catch_up: bool = False  # its last update failed: it must not sample until the next one
    backend: Identifier = ""  # the weight backend it receives on, as its place decided ("" = the learner's default)


@message("server_leaving")
@dataclass
class ServerLeaving:
    """A server's answer to `JobFinished`: it stops for good, and the coordinator forgets it at once."""

    server_id: Identifier  # the server that stops


# ----------------------------------------------------------------------------------------------
# A weight-sync round


@message("sync_prepare")
@dataclass
class SyncPrepare:
    """Round `round_id` is about to start: a server answers `SyncReady` at once, and only the servers that
    answer are put in the round's group. A heartbeat only says a server was there; this says it is now."""

    round_id: int  # the round the invite will carry


@message("sync_ready")
@dataclass
class SyncReady:
    server_id: Identifier  # answering server
    round_id: Count  # the round of the prepare it answers


@message("sync_invite")
@dataclass
class SyncInvite:
    """The coordinator asks a server to take part in round `round_id` and receive `version`; `init_info` says how
    to reach the weights when that changed since the server's last round (a new membership or a failed round)."""

    round_id: int  # increases with every round
    version: int  # policy version of the weights about to be sent
    update_info: dict[str, Any]  # names, dtypes and shapes of the tensors, in the order they are sent
    init_info: dict[str, Any] = field(default_factory=dict)  # non-empty: (re)join the backend this way first


@message("sync_done")
@dataclass
class SyncDone:
    server_id: Identifier  # reporting server
    round_id: Count  # round it took part in
    ok: bool  # the weights were received and loaded
    seconds: float = 0.0  # its pause-to-resume time
    error: str = ""  # why it failed, when it did
    retry_helps: bool = True  # False: it failed in a way no later round can fix (the learner gives up on it at once)


# ----------------------------------------------------------------------------------------------
# Measurements


@message("server_telemetry")
@dataclass
class ServerTelemetry:
    """A server's counters, every `rollout.weight_sync.heartbeat_s`, on a socket and schedule of their own:
    they keep coming while a weight-sync round occupies the server's sync client. The learner logs them as
    `rollout/*`; they say nothing about membership in rounds."""

    server_id: Identifier  # stable name of the rollout server
    version: Version  # policy version its engine holds now
    tokens_generated: int = 0  # completion tokens produced since the server started
    groups_sent: int = 0  # groups acknowledged by the buffer since the server started
    idle_seconds: float = 0.0  # time with nothing in the engine, since the server started
    uptime_seconds: float = 0.0  # time since the server started serving
    inflight: int = 0  # requests in its engine now
    chat_sessions: int = 0  # chat sessions open on it now (each holds a place within the staleness bound)
    chat_waiting: int = 0  # chat sessions waiting now for a place within the staleness bound
    chat_dropped_idle: int = 0  # chat sessions dropped unsent as idle (rollout.chat.session_idle_s) since the server started
    chat_lost: int = 0  # chat requests refused (HTTP 410) for sessions the server lost (idle drop, restart) since it started
    thrown_away_tokens: int = 0  # model tokens it sampled for training and will never send, since it started: groups cut short by its stop, chat sessions dropped as idle


@message("validation_result")
@dataclass
class ValidationResult:
    """One of a server's latest validation passes, sent beside its telemetry again every period while it is among
    them (the learner logs each pass once, and hears it even when it restarted since)."""

    server_id: Identifier  # the server that ran the pass
    version: Version  # policy version the pass validated
    metrics: dict[str, float]  # its val/* metrics


# ----------------------------------------------------------------------------------------------
# Requests of the learner


@message("validate_version")
@dataclass
class ValidateVersion:
    """The learner asks for a validation pass of `version` once a server holds it (its final version, which
    need not be a multiple of validation.every); sent again until the pass is reported, so a server that
    (re)joins late hears it too."""

    version: int  # policy version to validate


@message("task_weights")
@dataclass
class TaskWeights:
    """The learner's sampling weights of the training files (data.task_weights), sent every step while they
    move: a server draws its next prompts with them, a server that (re)joins gets them within a step."""

    version: int  # the policy version at which the learner set them
    weights: list[float]  # one share per data.train_files entry, in that order; they sum to 1


@message("job_finished")
@dataclass
class JobFinished:
    """The learner trained its last step: servers stop, and `asyncrl rollout` exits naming `version`."""

    version: int  # the final policy version (learner.total_steps)
