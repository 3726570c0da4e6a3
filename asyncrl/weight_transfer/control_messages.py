"""Messages of the control channel between the learner's coordinator and the rollout servers: the
weight-sync rounds, and the servers' telemetry beside them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.messages import message
from asyncrl.validation_scores import NOT_VALIDATED


@message("sync_join")
@dataclass
class SyncJoin:
    """A server announces itself; repeated as a heartbeat. Missing heartbeats drop it from rounds."""

    server_id: str  # stable name of the rollout server
    ranks: int  # group ranks the server needs (its tensor-parallel workers)
    version: int  # policy version its engine holds now
    needs_catch_up: bool = False  # its last update failed: it must not sample until the next one


@message("server_telemetry")
@dataclass
class ServerTelemetry:
    """A server's counters, every `rollout.weight_sync.heartbeat_s`, on a socket and schedule of their own:
    they keep coming while a weight-sync round occupies the server's sync client. The learner logs them as
    `rollout/*`; they say nothing about membership in rounds."""

    server_id: str  # stable name of the rollout server
    version: int  # policy version its engine holds now
    tokens_generated: int = 0  # completion tokens produced since the server started
    groups_sent: int = 0  # groups acknowledged by the buffer since the server started
    groups_resampled: int = 0  # groups stopped as too stale to be trained and sampled again, since the server started
    idle_seconds: float = 0.0  # time with nothing in the engine, since the server started
    uptime_seconds: float = 0.0  # time since the server started serving
    inflight: int = 0  # requests in its engine now
    chat_sessions: int = 0  # chat sessions open on it now (each holds a place within the staleness bound)
    chat_waiting: int = 0  # chat sessions waiting now for a place within the staleness bound
    chat_dropped_idle: int = 0  # chat sessions dropped unsent as idle (rollout.chat.session_idle_s) since the server started
    chat_lost: int = 0  # chat requests refused (HTTP 410) for sessions the server lost (idle drop, restart) since it started
    validation: dict[str, float] = field(default_factory=dict)  # val/* metrics of its latest validation pass
    validation_version: int = NOT_VALIDATED  # policy version that pass validated


@message("sync_prepare")
@dataclass
class SyncPrepare:
    """Round `round_id` is about to start: a server answers `SyncReady` at once, and only the servers that
    answer are put in the round's group. A heartbeat only says a server was there; this says it is now."""

    round_id: int  # the round the invite will carry


@message("sync_ready")
@dataclass
class SyncReady:
    server_id: str  # answering server
    round_id: int  # the round of the prepare it answers


@message("sync_invite")
@dataclass
class SyncInvite:
    """The coordinator asks a server to take part in round `round_id` and receive `version`."""

    round_id: int  # increases with every round
    version: int  # policy version of the weights about to be broadcast
    update_info: dict[str, Any]  # names, dtypes and shapes of the tensors, in broadcast order
    init_info: dict[str, Any] = field(default_factory=dict)  # non-empty: (re)join this new group first


@message("sync_done")
@dataclass
class SyncDone:
    server_id: str  # reporting server
    round_id: int  # round it took part in
    ok: bool  # the weights were received and loaded
    seconds: float = 0.0  # its pause-to-resume time
    error: str = ""  # why it failed, when it did


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


@message("server_leaving")
@dataclass
class ServerLeaving:
    """A server's answer to `JobFinished`: it stops for good, and the coordinator forgets it at once."""

    server_id: str  # the server that stops
