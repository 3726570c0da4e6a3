"""The buffer service: one ROUTER socket, one loop thread (plus a thread that only runs fsync).

Each turn drains up to max_receive_batch frames. Trajectory groups among them are checked and appended
in one log write; they are acknowledged, and handed to consumers, only once durable. Under the batch
policy that is group commit: one fsync at a time runs on a helper thread, covering every record
written before it started, while the loop goes on receiving and writing the next records, which the
following fsync covers. Control messages are answered after the turn's write (a batch request sees
the groups that are durable by then). Batch requests that want to wait for data are parked until
they can be filled or their wait runs out, within caps (buffer.parking). Anything that does not
decode (numbers out of range included), or is too large, gets an ErrorReply, is counted and logged; so
does a well-formed request the buffer refuses (a bad position, a client over its caps). A group whose token
versions no server could have sampled with (`buffer/versions.py`) is refused the same way, in an Ack with the
error that names its record, so its producer stops sending it. The loop carries
on, and nothing a client sends reaches the state the other clients are served from.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from asyncrl.config.buffer import BufferConfig
from buffer.group_summary import GroupSummary, summarize_group
from asyncrl.heap import freeze_startup_heap, keep_freed_memory
from asyncrl.buffer_process import ENDPOINT_FILE
from asyncrl.messages import (BUFFERS_OWN_STALENESS, Ack, AdmissionGrant, AdmissionRequest, BatchRequest, BufferPosition,
                              BufferStats, Commit, DecodeError, ErrorReply, PolicyVersion, StatsRequest, decode, encode,
                              encode_batch)
from asyncrl.transport.sockets import ServingRouter
from asyncrl.units import MS_PER_S
from buffer.admission import Admission, LeasesFull
from buffer.background_fsync import BackgroundFsync
from buffer.dir_lock import DirectoryLock
from buffer.log import Payload
from buffer.metrics import Counters, GeneratedByStart, IngestRate
from buffer.parking import OverClientCap, ParkedRequest, ParkedRequests, ParkingCaps
from buffer.store import OffsetError, TrajectoryStore
from buffer.versions import HeardVersion
from buffer.window import BatchLimits, Selection

log = logging.getLogger(__name__)

HOUSEKEEPING_MS = 200  # longest sleep of the loop: admission leases expire and parked waits end on time
BATCH_ENVELOPE_BYTES = 256  # room for a Batch's own fields beside its groups' bytes
REJECT_LOG_INTERVAL_S = 1.0  # at most one log line per interval about rejected frames or refused requests (all are counted)


class OverCap(Exception):
    """A well-formed request asks for more than the buffer's caps allow this client."""


class BufferService:
    def __init__(self, config: BufferConfig, directory: str | Path) -> None:
        self.config = config
        self.directory = Path(directory)
        self.store = TrajectoryStore(config, self.directory)
        self.admission = Admission(config.starting_staleness(), config.batch_groups, config.admission_timeout_s,
                                   config.max_leases)
        self.counters = Counters()
        self.generated = GeneratedByStart()
        for entry in self.store.window.entries.values():  # the groups a restart read back from the log, in log order
            self.generated.add(entry.oldest_version, entry.num_samples, entry.response_tokens)
        self.rate = IngestRate(config.stats_window_s)
        self.policy_version = self.store.committed.policy_version
        self.heard = HeardVersion(self.directory)
        self.parked = ParkedRequests(ParkingCaps(config.max_parked_per_client, config.max_parked,
                                                 config.max_parked_ahead))
        self.running = True
        self._next_reject_log = 0.0
        self.router = ServingRouter(config.bind_host, config.port, config.max_message_bytes, config.curve_dir)
        self.socket, self.endpoint = self.router.socket, self.router.endpoint
        self.background_fsync = BackgroundFsync() if config.fsync == "batch" else None
        self._fsync_covers = 0  # writes (oldest first) that the running background fsync covers
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        if self.background_fsync is not None:
            self.poller.register(self.background_fsync.fileno(), zmq.POLLIN)
        self._handlers: dict[type, Callable[[bytes, Any], None]] = {
            AdmissionRequest: self._on_admission,
            BatchRequest: self._on_batch_request,
            Commit: self._on_commit,
            PolicyVersion: self._on_policy_version,
            StatsRequest: self._on_stats,
        }
        _write_endpoint(self.directory, self.endpoint)
        log.info("buffer serving at %s (dir %s, fsync %s)", self.endpoint, self.directory, config.fsync)

    # ------------------------------------------------------------------------------------------
    # Loop

    def serve(self) -> None:
        """Run until `stop()` (e.g. from a signal handler)."""
        try:
            while self.running:
                ready = dict(self.poller.poll(self._poll_timeout_ms()))
                if self.background_fsync is not None and self.background_fsync.fileno() in ready:
                    self._on_fsync_done(self.background_fsync.finish())
                if self.socket in ready:
                    self.handle(self._drain())
                now = time.monotonic()
                self._answer_parked(now)
                self.admission.expire(now)
        finally:
            self.close()

    def stop(self) -> None:
        self.running = False

    def _poll_timeout_ms(self) -> int:
        soonest_deadline = self.parked.soonest_deadline()
        if soonest_deadline is None:
            return HOUSEKEEPING_MS
        soonest = soonest_deadline - time.monotonic()
        return max(0, min(HOUSEKEEPING_MS, int(soonest * MS_PER_S)))

    def _drain(self) -> list[list[zmq.Frame]]:
        """Up to max_receive_batch waiting messages, as ZeroMQ frames: a record's bytes are checked and
        written from the message ZeroMQ received them into, never copied (nothing keeps them after the
        turn, so ZeroMQ's allocator reuses that memory for the next messages)."""
        messages = []
        while len(messages) < self.config.max_receive_batch:
            try:
                messages.append(self.socket.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        return messages

    def handle(self, messages: list[list[zmq.Frame]]) -> None:
        """Ingest the trajectory groups among `messages` durably, then answer the rest in order."""
        groups: list[tuple[bytes, GroupSummary, Payload]] = []
        controls: list[tuple[bytes, Any]] = []
        for identity_frame, *frames in messages:
            identity, payloads = identity_frame.bytes, [frame.buffer for frame in frames]
            parsed = self._parse(identity, payloads)
            if isinstance(parsed, GroupSummary):
                groups.append((identity, parsed, payloads[0]))
            elif parsed is not None:
                controls.append((identity, parsed))
        if groups:
            self._ingest(groups)
        for identity, message in controls:
            try:
                self._handlers.get(type(message), self._on_unexpected)(identity, message)
            except Exception as error:  # one failing request must not stop the service for everyone
                log.exception("failed to answer a '%s' request", type(message).kind)
                self._reply(identity, ErrorReply(f"internal error answering '{type(message).kind}': {error}"))

    def _parse(self, identity: bytes, frames: list[Payload]) -> GroupSummary | Any | None:
        """A GroupSummary for a trajectory group, the message for anything else, None if rejected."""
        if len(frames) != 1:
            return self._reject(identity, f"expected 1 frame per message, got {len(frames)}")
        frame = frames[0]
        if len(frame) > self.config.max_message_bytes:
            return self._reject(identity, f"message of {len(frame)} bytes exceeds {self.config.max_message_bytes}")
        try:
            summary = summarize_group(frame)
        except DecodeError:
            summary = None  # not a (valid) group: decode tells which, with the precise reason
        if summary is not None:
            return self._with_sound_versions(identity, summary)
        try:
            return decode(frame, self.config.max_message_bytes)
        except DecodeError as error:
            return self._reject(identity, str(error))

    def _with_sound_versions(self, identity: bytes, summary: GroupSummary) -> GroupSummary | None:
        """The group, unless a token version is one no server could have sampled with (`buffer/versions.py`): then its
        producer is told why, in a final refusal of the record (an Ack with the error), and it is counted as rejected."""
        reason = self.heard.refusal(*summary.token_versions)
        if not reason:
            return summary
        self.counters.rejected_frames += 1
        self._log_refusal("rejected a group", identity, self.counters.rejected_frames, reason)
        self._reply(identity, Ack(summary.record_id, -1, error=reason))
        return None

    def _reject(self, identity: bytes, reason: str) -> None:
        """A frame that is no request the buffer takes."""
        self.counters.rejected_frames += 1
        self._log_refusal("rejected a frame", identity, self.counters.rejected_frames, reason)
        self._reply(identity, ErrorReply(reason))
        return None

    def _refuse(self, identity: bytes, error: Exception) -> None:
        """A well-formed request the buffer will not serve: a bad position, or a client over its caps."""
        self.counters.refused_requests += 1
        self.counters.refused_over_caps += isinstance(error, (OverCap, OverClientCap, LeasesFull))
        self._log_refusal("refused a request", identity, self.counters.refused_requests, str(error))
        self._reply(identity, ErrorReply(str(error)))

    def _log_refusal(self, what: str, identity: bytes, count: int, reason: str) -> None:
        now = time.monotonic()
        if now >= self._next_reject_log:  # a flood of junk must not flood the log too
            log.warning("%s from peer %s (%d so far): %s", what, identity.hex(), count, reason)
            self._next_reject_log = now + REJECT_LOG_INTERVAL_S

    def _reply(self, identity: bytes, message: Any) -> None:
        self._send(identity, encode(message))

    def _send(self, identity: bytes, payload: bytes) -> None:
        self.socket.send_multipart([identity, payload])

    # ------------------------------------------------------------------------------------------
    # Ingest

    def _ingest(self, groups: list[tuple[bytes, GroupSummary, Payload]]) -> None:
        """Write the groups; acknowledge them once durable (at once, or when their background fsync ends)."""
        try:
            results, written = self.store.write([(summary, frame) for _, summary, frame in groups],
                                                defer_fsync=self.background_fsync is not None)
        except OSError as error:
            log.error("log write failed, nothing of this batch stored: %s", error)
            self._refuse_write([(identity, summary.record_id) for identity, summary, _ in groups], error)
            self._discard_awaiting_fsync(error)  # a failing disk: what is not yet fsynced cannot be trusted either
            return
        for (identity, summary, _), stored in zip(groups, results):
            if stored.full:
                self.counters.full_rejections += 1
                self._reply(identity, Ack(summary.record_id, -1, error="buffer full",
                                          retry_after_ms=self.config.retry_after_ms))
            else:
                written.acks.append((identity, Ack(summary.record_id, stored.offset, duplicate=stored.duplicate)))
        if self.background_fsync is None or (not written.entries and len(self.store.awaiting_fsync) == 1):
            self._publish(1)  # durable already (or only duplicates of durable records)
        else:
            self._start_fsync()

    def _start_fsync(self) -> None:
        """fsync everything written so far, unless an fsync is running (the next one will cover it)."""
        if self.background_fsync is not None and not self.background_fsync.busy and self.store.awaiting_fsync:
            self._fsync_covers = len(self.store.awaiting_fsync)
            self.background_fsync.start(self.store.log.fsync_fd())

    def _on_fsync_done(self, error: OSError | None) -> None:
        if error is None:
            self._publish(self._fsync_covers)
            self._fsync_covers = 0
        else:
            log.error("log fsync failed: %s", error)
            self._discard_awaiting_fsync(error)
        self._start_fsync()

    def _discard_awaiting_fsync(self, error: OSError) -> None:
        """Cut every record not yet fsynced out of the log and tell its producer to resend."""
        dropped = self.store.discard_awaiting_fsync()
        if dropped:
            log.error("cut %d write(s) awaiting fsync from the log; their producers will resend", len(dropped))
        for written in dropped:
            self._refuse_write([(identity, ack.record_id) for identity, ack in written.acks], error)
        self._fsync_covers = 0  # an fsync still running covers none of what remains

    def _publish(self, count: int) -> None:
        """The oldest `count` writes are durable: consumers may have them, producers get their acks.

        A producer's acks go out as one message of one frame per ack: each send wakes ZeroMQ's I/O
        thread (~15 µs of CPU per ack here, and often a reschedule on 2 cores), and a producer reads
        frames one at a time, so it sees the same complete Ack messages as before."""
        acks: dict[bytes, list[bytes]] = {}
        for written in self.store.publish(count):
            for identity, ack in written.acks:
                self.counters.duplicates += ack.duplicate
                acks.setdefault(identity, []).append(encode(ack))
            self.counters.ingested += len(written.entries)
            self.counters.ingested_samples += sum(entry.num_samples for entry in written.entries)
            self.counters.ingested_response_tokens += sum(entry.response_tokens for entry in written.entries)
            for entry in written.entries:
                self.generated.add(entry.oldest_version, entry.num_samples, entry.response_tokens)
            self.rate.add(time.monotonic(), len(written.entries), written.nbytes)
        for identity, frames in acks.items():
            self.socket.send_multipart([identity, *frames])

    def _refuse_write(self, records: list[tuple[bytes, str]], error: OSError) -> None:
        """Nothing of these records is stored: tell their producers to resend."""
        for identity, record_id in records:
            self._reply(identity, Ack(record_id, -1, error=f"log write failed: {error}",
                                      retry_after_ms=self.config.retry_after_ms))

    # ------------------------------------------------------------------------------------------
    # Consumption

    def _on_batch_request(self, identity: bytes, request: BatchRequest) -> None:
        self._hear_version(request.policy_version)
        self._hear_bound(request.max_staleness)
        parked = ParkedRequest(identity, request, time.monotonic() + request.timeout_ms / MS_PER_S)
        try:
            self._check_wait(request)
            self.store.use(identity)
            self.store.seek(request.from_offset, request.from_ahead)
            if request.timeout_ms > 0 and not self._can_fill(parked):
                self.parked.check_client(request)
                self._park(parked)
                return
        except (OffsetError, OverCap, OverClientCap) as error:
            self._refuse(identity, error)
            return
        self._answer(parked)

    def _check_wait(self, request: BatchRequest) -> None:
        if request.timeout_ms > self.config.max_wait_s * MS_PER_S:
            raise OverCap(f"batch request wait of {request.timeout_ms} ms exceeds buffer.max_wait_s={self.config.max_wait_s}")

    def _park(self, parked: ParkedRequest) -> None:
        """Wait for data if the total caps leave room; otherwise answer now with what there is."""
        if self.parked.has_room(parked.request):
            self.parked.park(parked)
        else:
            self.counters.unparked += 1
            self._answer(parked)

    def _answer_parked(self, now: float) -> None:
        for parked in self.parked.pop_ready(now, self._can_fill):
            self._answer(parked)

    def _can_fill(self, parked: ParkedRequest) -> bool:
        request = parked.request
        selection = self.store.consumers.peek(parked.identity).plan(self._limits(request))
        unlimited = request.max_samples <= 0 and request.max_tokens <= 0
        return selection.full or (unlimited and bool(selection.taken))

    def _answer(self, parked: ParkedRequest) -> None:
        self.store.use(parked.identity)
        try:  # a parked request's position may have been committed past since it arrived
            self.store.seek(parked.request.from_offset, parked.request.from_ahead)
        except OffsetError as error:
            self._refuse(parked.identity, error)
            return
        selection = self.store.take(self._limits(parked.request))
        self._count_handout(selection)
        next_offset, next_ahead = self.store.window.position()
        self._send(parked.identity, encode_batch(self.store.frames(selection.taken),
                                                 [entry.offset for entry in selection.taken],
                                                 next_offset, len(selection.dropped), next_ahead))

    def _limits(self, request: BatchRequest) -> BatchLimits:
        return BatchLimits(request.policy_version, self.admission.max_staleness, request.max_samples, request.max_tokens,
                           max_bytes=self.config.max_message_bytes - BATCH_ENVELOPE_BYTES)

    def _count_handout(self, selection: Selection) -> None:
        counters = self.counters
        counters.handed_out += len(selection.taken)
        counters.handed_out_samples += sum(entry.num_samples for entry in selection.taken)
        counters.handed_out_response_tokens += sum(entry.response_tokens for entry in selection.taken)
        self.generated.hand_out(counters.handed_out_samples)
        counters.dropped_stale += len(selection.dropped)
        counters.dropped_stale_response_tokens += sum(entry.response_tokens for entry in selection.dropped)
        counters.staleness.update(selection.staleness)
        if selection.dropped:
            log.warning("dropped %d group(s) that started from weights more than %d versions behind the learner",
                        len(selection.dropped), self.admission.max_staleness)

    def _on_commit(self, identity: bytes, commit: Commit) -> None:
        self._hear_version(commit.policy_version)
        self.store.use(identity)
        try:
            self.store.commit(commit.offset, commit.policy_version, commit.ahead)
        except OffsetError as error:
            self._refuse(identity, error)
            return
        self._reply(identity, self._position())

    # ------------------------------------------------------------------------------------------
    # Admission, versions, stats

    def _on_admission(self, identity: bytes, request: AdmissionRequest) -> None:
        try:
            granted = self.admission.grant(request.server_id, request.wanted, request.finished, self._sampling_version(),
                                           self.store.accepted, time.monotonic(), request.request_id, request.running)
        except LeasesFull as error:
            self._refuse(identity, error)
            return
        self._reply(identity, AdmissionGrant(granted, self.policy_version, self.admission.max_staleness))

    def _on_policy_version(self, identity: bytes, update: PolicyVersion) -> None:
        self._hear_version(update.version)
        self._reply(identity, self._position())

    def _sampling_version(self) -> int:
        """The version that samples started now are stamped with, which admission plans from: the learner's, or
        under buffer.study_lag_versions the lagged weights' (so the lag counts against K and, with K equal to
        the lag, exactly one batch starts per version)."""
        return self.policy_version - self.config.study_lag_versions

    def _hear_version(self, version: int) -> None:
        self.policy_version = max(self.policy_version, version)
        self.heard.hear(version)

    def _hear_bound(self, max_staleness: int) -> None:
        """The learner's K (-1: it sent none): admission, selection and the servers' grants follow it."""
        if max_staleness not in (BUFFERS_OWN_STALENESS, self.admission.max_staleness):
            log.info("max_staleness %d -> %d (the learner's)", self.admission.max_staleness, max_staleness)
            self.admission.max_staleness = max_staleness

    def _position(self) -> BufferPosition:
        return BufferPosition(self.store.consumers.learner.read_offset, self.store.committed.offset, self.store.end_offset,
                              self.policy_version)

    def _on_stats(self, identity: bytes, _: StatsRequest) -> None:
        self._reply(identity, self.stats())

    def stats(self) -> BufferStats:
        groups_per_s, bytes_per_s = self.rate.rates(time.monotonic())
        counters, window = self.counters, self.store.consumers.learner
        first_samples, first_tokens = self.generated.taken
        return BufferStats(
            size=len(window), size_bytes=window.bytes, log_bytes=self.store.log.disk_bytes,
            read_offset=window.read_offset, committed_offset=self.store.committed.offset,
            end_offset=self.store.end_offset, policy_version=self.policy_version,
            ingested=counters.ingested, ingested_samples=counters.ingested_samples,
            ingested_response_tokens=counters.ingested_response_tokens, duplicates=counters.duplicates,
            ingest_groups_per_s=groups_per_s, ingest_bytes_per_s=bytes_per_s,
            handed_out=counters.handed_out, handed_out_samples=counters.handed_out_samples,
            handed_out_response_tokens=counters.handed_out_response_tokens, dropped_stale=counters.dropped_stale,
            dropped_stale_response_tokens=counters.dropped_stale_response_tokens,
            first_generated_samples=first_samples, first_generated_response_tokens=first_tokens,
            staleness_histogram=dict(counters.staleness), rejected_frames=counters.rejected_frames,
            full_rejections=counters.full_rejections, admission_running=self.admission.running,
            admission_waits=self.admission.waits, admission_wait_s=self.admission.wait_s,
            admission_released=self.admission.released, read_ahead=window.position()[1],
            refused_requests=counters.refused_requests, refused_over_caps=counters.refused_over_caps,
            unparked=counters.unparked, parked=len(self.parked), admission_leases=len(self.admission.leases),
            consumers=len(self.store.consumers), position_rereads=self.store.position_rereads,
            max_staleness=self.admission.max_staleness,
        )

    def _on_unexpected(self, identity: bytes, message: Any) -> None:
        self._reject(identity, f"the buffer does not take '{type(message).kind}' messages")

    def close(self) -> None:
        if self.background_fsync is not None:
            self.background_fsync.close()
        self.router.close()
        self.store.close()


def run_buffer(config: BufferConfig, directory: str | Path) -> None:
    """Serve until SIGTERM or SIGINT, then close the log cleanly (a kill -9 is recovered on the next start).
    The directory is locked first: a predecessor still shutting down is waited for, never written beside."""
    with DirectoryLock(Path(directory), config.lock_timeout_s):
        if config.heap_keep_bytes:
            keep_freed_memory(config.heap_keep_bytes)  # received frames reuse freed ones' pages instead of faulting
        service = BufferService(config, directory)
        freeze_startup_heap()  # after recovery: what the log's index holds now lives as long as the service
        for stop_signal in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop_signal, lambda *_: service.stop())
        service.serve()


def _write_endpoint(directory: Path, endpoint: str) -> None:
    """Publish the bound address atomically: a reader sees no file or the whole address."""
    temporary = directory / (ENDPOINT_FILE + ".tmp")
    temporary.write_text(endpoint)
    temporary.replace(directory / ENDPOINT_FILE)
