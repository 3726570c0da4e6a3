"""Config section of the trajectory buffer service and of the clients that talk to it."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.config.fields import bounded, one_of
from asyncrl.net import is_loopback
from asyncrl.wire_limits import MAX_AHEAD, MAX_COUNT, MAX_VERSION
from asyncrl.staleness import starts_within_bound

AUTO = "auto"  # buffer.max_staleness chosen during the run by the pacing controller

C_INT_MAX = 2**31 - 1  # mallopt takes a C int


@dataclass
class PacingConfig:
    """`buffer.max_staleness: auto`: the learner chooses K between `k_min` and `k_max` from what it measures
    (`learner/services/pacing.py`, `docs/tuning.md`)."""

    k_min: int = bounded(1, 0, MAX_VERSION)  # smallest K the controller chooses
    k_max: int = bounded(8, 0, MAX_VERSION)  # largest K it ever chooses
    k_start: int = bounded(1, 0, MAX_VERSION)  # K of a new run's first steps (taken into [k_min, k_max]); a resumed run keeps its checkpoint's K
    window: int = bounded(5, 1)  # learner steps each decision reads; after a change K holds this long (the signals then describe the new K)
    raise_wait_share: float = bounded(0.1, 0.0, 1.0)  # raise K while the learner waited for batches more than this share of its step time
    max_mismatch_kl: float = bounded(0.02, 0.0)  # drift bound: lower K when the window's mean rollout_corr/mismatch_kl is above it
    max_is_clip_frac: float = bounded(0.05, 0.0, 1.0)  # drift bound: lower K when the window's mean rollout_corr/is_clip_frac is above it
    raise_headroom: float = bounded(0.5, 0.0, 1.0)  # raise only while both drift signals are under this share of their bounds (room for one more version)

    def clamp(self, k: int) -> int:
        """`k` taken into [k_min, k_max]."""
        return min(max(k, self.k_min), self.k_max)


@dataclass
class BufferConfig:
    address: str = ""  # tcp://host:port of a running buffer to use; empty = the learner starts its own
    max_restarts: int = bounded(5, 0)  # the learner's own buffer: restarts in a row of one dying within rollout.healthy_after_s of its start (back-off rollout.restart_backoff_s, doubling); its next such death fails the learner
    bind_host: str = "127.0.0.1"  # interface the service binds; anything but loopback requires curve_dir
    port: int = bounded(0, 0, 65535)  # TCP port of the service; 0 = a free port, written to <dir>/endpoint (a learner's buffer: chosen at the run's first start, kept in <run>/ports.json, bound again at its restarts)
    dir: str = ""  # log segments, committed offset and endpoint file; empty = <run dir>/buffer
    lock_timeout_s: float = bounded(30.0, 0.0)  # a buffer whose dir another buffer process holds waits this long, then fails
    fsync: str = one_of("batch", "always", "none")  # before acks: fsync per received batch, per record, or never
    segment_bytes: int = bounded(64 * 2**20, 4096)  # log segments close past this size; retention deletes whole ones
    max_memory_bytes: int = bounded(2 * 2**30, 1)  # bytes of groups waiting to be handed out; past it producers retry
    max_disk_bytes: int = bounded(64 * 2**30, 1)  # bytes of log not yet released by commits; past it producers retry
    max_staleness: str = "1"  # K: a group starts only from weights at most this many versions behind the learner, then is trained in full; auto = chosen during the run within `pacing`
    pacing: PacingConfig = field(default_factory=PacingConfig)  # bounds and signals of max_staleness=auto
    study_lag_versions: int = bounded(0, 0, MAX_VERSION)  # study setting L: the servers get the learner's weights of L versions ago and admission counts the lag against K, so samples are trained L to K versions stale (K = L: exactly L, one batch per version; docs/tuning.md); 0 = off
    batch_groups: int = bounded(32, 1, MAX_COUNT)  # groups the learner trains on per step (the admission formula's batch)
    admission_timeout_s: float = bounded(120.0, 0.01)  # a server silent this long has its admitted groups released
    retry_after_ms: int = bounded(50, 1)  # wait a producer is told to take before resending when the buffer is full
    max_message_bytes: int = bounded(64 * 2**20, 1024)  # larger frames are rejected with an error reply
    max_receive_batch: int = bounded(256, 1)  # frames drained per loop turn; one log write and fsync cover them
    heap_keep_bytes: int = bounded(64 * 2**20, 0, C_INT_MAX)  # freed bytes malloc keeps for new frames (glibc); 0 = libc default
    stats_window_s: float = bounded(10.0, 0.1)  # window of the ingest-rate metrics
    max_wait_s: float = bounded(600.0, 0.0)  # longest wait (s) a batch request may ask for; a longer one is refused
    max_parked_per_client: int = bounded(4, 0)  # batch requests one consumer id may have waiting for data; more are refused
    max_parked: int = bounded(64, 0)  # batch requests of all consumers waiting for data; past it one is answered at once
    max_parked_ahead: int = bounded(2**18, 0, MAX_AHEAD * 2**10)  # from_ahead entries all waiting requests hold; past it one is answered at once
    max_consumers: int = bounded(8, 2, 2**10)  # consumers (client ids) with a read position of their own; past it the least recent is forgotten
    max_leases: int = bounded(1024, 1, 2**20)  # admission leases (server ids) held at once; a new server past it is refused until one expires
    curve_dir: str = ""  # CURVE keys from `asyncrl keygen`; set = encrypt and authenticate every connection
    client_timeout_s: float = bounded(30.0, 0.01)  # clients: deadline for a reply (ack, batch, grant)
    client_resend_s: float = bounded(5.0, 0.01)  # clients: resend a request or record unanswered this long (a restarted buffer gets it)

    @property
    def paced(self) -> bool:
        """K is chosen during the run (max_staleness=auto)."""
        return self.max_staleness == AUTO

    def starting_staleness(self) -> int:
        """K at the start of a run: the fixed value, or the pacing controller's start inside its bounds."""
        return self.pacing.clamp(self.pacing.k_start) if self.paced else int(self.max_staleness)

    def cross_checks(self) -> list[tuple[str, str]]:
        problems = []
        value = self.max_staleness
        if value != AUTO and not (value.isdigit() and int(value) <= MAX_VERSION):
            problems.append(("buffer.max_staleness", f"'{value}' is neither 'auto' nor a whole number of versions in [0, {MAX_VERSION}]"))
        if self.pacing.k_min > self.pacing.k_max:
            problems.append(("buffer.pacing.k_min", f"{self.pacing.k_min} exceeds buffer.pacing.k_max={self.pacing.k_max}"))
        if not is_loopback(self.bind_host) and not self.curve_dir:
            problems.append(("buffer.bind_host", f"'{self.bind_host}' is not loopback: set buffer.curve_dir (keygen)"))
        smallest_k = self.pacing.k_min if self.paced else int(value) if value.isdigit() else None  # auto never goes below k_min
        if smallest_k is not None and not starts_within_bound(self.study_lag_versions, 0, smallest_k):  # weights that far back
            problems.append(("buffer.study_lag_versions",
                             f"{self.study_lag_versions} exceeds buffer.max_staleness={self.max_staleness}: no group could "
                             "start from weights that far behind the learner (set max_staleness to the lag to train "
                             "samples exactly that stale; with auto, K can go down to buffer.pacing.k_min)"))
        if self.address and not self.address.startswith("tcp://"):
            problems.append(("buffer.address", f"'{self.address}' must look like tcp://host:port"))
        return problems
