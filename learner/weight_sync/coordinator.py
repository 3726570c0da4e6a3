"""The learner's side of weight sync rounds: who takes part, the group, the broadcast, the outcome.

Servers announce themselves with `ServerHeartbeat`s on the coordinator's ROUTER socket. A round
first asks every live server to confirm it is there (`SyncPrepare` → `SyncReady`, within `liveness_s`),
so a server that died since its last heartbeat costs that wait, not a rendezvous deadline; it then
invites the servers that answered, (re)builds the transfer group when membership changed or the last
round failed, broadcasts, and waits for each server's `SyncDone` until the deadline. A server that fails
or stays silent is left out of the round; it rejoins with its next heartbeat and catches up in the next
round. How the weights travel is the backend's (`asyncrl.weight_transfer.backends`), and each server names the
one it receives on in its heartbeats (ipc beside the learner, nccl on GPUs of its own, in one job): a round has a
leg per backend in use, each driving that backend's `SendingEnd` (`SendingEnds`) for its servers alone (stage
before the invitations, connect after them, send), so a failure on one backend fails its servers only and
leaves the other backends' groups standing. Every wait is bounded, so the
learner never hangs on a server. Servers also send their counters (`ServerTelemetry`) and their latest
validation passes (`ValidationResult`) on the same channel, apart from the heartbeats: the latest counters of each
server are kept for `rollout_metrics`, and every pass not returned yet for `new_validations`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Collection, Iterator

from asyncrl.messages import DecodeError, decode, encode
from asyncrl.transport.control import bind_control
from asyncrl.units import MS_PER_S
from asyncrl.validation_scores import NOT_VALIDATED, VERSION_KEY
from asyncrl.weight_transfer.control_messages import (JobFinished, ServerHeartbeat, ServerLeaving, ServerTelemetry,
                                                      SyncDone, SyncInvite, SyncPrepare, SyncReady, ValidationResult)
from asyncrl.weight_transfer.group import GroupAddress, WeightTransferError
from asyncrl.weight_transfer.interface import SendingEnd, Staged
from asyncrl.weight_transfer.protocol import NamedTensors, update_info_for
from learner.weight_sync.sending_ends import SendingEnds
from learner.weight_sync.server_metrics import ServerMetrics

log = logging.getLogger(__name__)

_FIRST_SERVER_RANK = 1  # rank 0 is the trainer


class WeightSyncFailed(RuntimeError):
    """No rollout server can load the learner's weights; the message holds each one's last error."""


@dataclass
class Member:
    identity: bytes  # ZeroMQ routing id of the server's socket
    ranks: int  # group ranks it occupies
    last_seen: float  # monotonic time of its last heartbeat
    version: int  # version it holds (reported, or loaded in a successful round)
    needs_catch_up: bool = False  # its last update failed: it holds no complete weights
    backend: str = ""  # the weight backend it announced ("" = the job's default)


@dataclass
class RoundReport:
    version: int  # policy version broadcast
    servers: int  # servers live when the round began (asked to take part)
    succeeded: list[str] = field(default_factory=list)  # servers that loaded the weights
    failed: dict[str, str] = field(default_factory=dict)  # server -> reason
    hopeless: set[str] = field(default_factory=set)  # failed servers whose error no retry can fix (its raiser said so)
    seconds: float = 0.0  # coordinator wall time of the round
    transfer_seconds: float = 0.0  # broadcast time alone
    max_server_pause_s: float = 0.0  # longest pause-to-resume reported by a server


@dataclass
class _Leg:
    """One backend's part of a round: its invited servers and the weights staged for them."""

    backend: str  # the backend's name
    end: SendingEnd  # the learner's end of it
    members: list[str]  # the invited servers that receive on it
    identities: tuple[bytes, ...]  # their socket identities: the group's membership
    staged: Staged  # the round's weights, ready to send on it
    address: GroupAddress | None = None  # where a new group meets; None: the servers keep the one they joined
    init_infos: dict[str, dict] = field(default_factory=dict)  # each server's init request of a new group


class SyncCoordinator:
    def __init__(self, bind: str, group_host: str, group_port: int, weights: SendingEnds, timeout_s: float,
                 liveness_s: float, max_failures: int = 3, curve_dir: str = "") -> None:
        """`weights`: the learner's end of each backend the servers receive on, closed with the coordinator.
        `group_port`: where each new group meets (0: a free port). `max_failures`: rounds in a row a
        server may fail before it is given up on (left out of rounds until it restarts). `curve_dir`: the job's
        CURVE keys (buffer.curve_dir); required when `bind` is not loopback, and then only servers holding the
        authorised client key can join."""
        self._router = bind_control(bind, curve_dir)
        self.socket, self.address = self._router.socket, self._router.endpoint
        self.group_host, self.group_port = group_host, group_port
        self.timeout_s, self.liveness_s = timeout_s, liveness_s
        self.members: dict[str, Member] = {}
        self._ends = weights
        self._group_members: dict[str, tuple[bytes, ...]] = {}  # backend -> its group's socket identities (a restarted server is new)
        self._round = 0
        self._server_metrics = ServerMetrics()
        self._telemetry: dict[str, tuple[float, ServerTelemetry]] = {}  # server -> (monotonic time received, latest)
        self._unlogged: dict[tuple[str, int], ValidationResult] = {}  # (server, version) -> a pass not returned yet
        self.latest_version = 0  # newest version broadcast
        self._validations_logged: dict[str, int] = {}  # server -> newest validated version already returned
        self.max_failures = max_failures
        self._failures: dict[str, tuple[int, str]] = {}  # server -> (rounds failed in a row, last error)
        self._given_up: dict[str, bytes] = {}  # server -> identity of the process given up on (a restart is new)
        self._identities: dict[str, bytes] = {}  # server -> identity of its latest heartbeat (kept when forgotten)

    def live_members(self) -> list[str]:
        self._drain()
        now = time.monotonic()
        return sorted(name for name, m in self.members.items() if now - m.last_seen <= self.liveness_s)

    def lagging_members(self, version: int) -> list[str]:
        """Live servers, not given up on, that hold an older version than `version`, or no complete weights."""
        live = self._syncable()
        return [name for name in live if self.members[name].version < version or self.members[name].needs_catch_up]

    def _syncable(self) -> list[str]:
        """Live servers except those given up on (a restarted process, with a new identity, is taken again)."""
        return [name for name in self.live_members() if self._given_up.get(name) != self.members[name].identity]

    def _record_outcome(self, report: RoundReport) -> None:
        """Count each server's failures in a row; give up on one that reached `max_failures` or failed in a way
        no retry can fix (logged once, with the error); raise WeightSyncFailed when no live server is left."""
        for name in report.succeeded:
            self._failures.pop(name, None)
        for name, reason in report.failed.items():
            count = self._failures.get(name, (0, ""))[0] + 1
            self._failures[name] = (count, reason)
            hopeless = name in report.hopeless
            identity = self._identities.get(name)
            if (count >= self.max_failures or hopeless) and identity is not None and self._given_up.get(name) != identity:
                self._given_up[name] = identity
                why = "an error no retry can fix" if hopeless else f"{count} rounds in a row (rollout.weight_sync.max_failures)"
                log.error("giving up on %s until it restarts: it failed to load the weights, %s: %s", name, why, reason)
        live = self.live_members()
        if live and not self._syncable() and report.failed:
            errors = "; ".join(f"{name}: {self._failures.get(name, (0, 'unknown'))[1]}" for name in live)
            raise WeightSyncFailed(f"no rollout server can load the learner's weights ({errors})")

    def rollout_metrics(self, learner_version: int | None = None) -> dict[str, float]:
        """Server counters summed over servers whose telemetry arrived within `liveness_s`: 
        `rollout/idle_ratio` over the servers' lifetimes, `rollout/servers`; per-server rates, in-flight
        requests and version lag behind `learner_version` (default: the newest version broadcast), see
        `ServerMetrics`."""
        self._drain()
        beats = _heard_within(self._telemetry, self.liveness_s)
        uptime = sum(b.uptime_seconds for b in beats)
        idle = sum(b.idle_seconds for b in beats)
        return {
            "rollout/servers": float(len(beats)),
            "rollout/idle_ratio": idle / uptime if uptime else 0.0,
            "rollout/groups_sent": float(sum(b.groups_sent for b in beats)),
            "rollout/chat_sessions": float(sum(b.chat_sessions for b in beats)),
            "rollout/chat_waiting": float(sum(b.chat_waiting for b in beats)),
            "rollout/chat_dropped_idle": float(sum(b.chat_dropped_idle for b in beats)),
            "rollout/chat_lost": float(sum(b.chat_lost for b in beats)),
            "rollout/thrown_away_tokens": float(self._server_metrics.thrown_away_tokens(
                [report for _, report in self._telemetry.values()])),
        } | self._server_metrics.metrics(
            beats, {name: member.version for name, member in self.members.items()},
            self.latest_version if learner_version is None else learner_version,
        )

    def new_validations(self) -> list[dict[str, float]]:
        """`val/*` of every validation pass that a server reported and no earlier call returned (each pass once, a
        server's passes in the order of the versions they validated), each with `val/version` the policy version
        it validated; [] when there is none. A pass is kept until returned, even when its server fell silent since:
        it is a measurement already made."""
        self._drain()
        fresh = sorted(self._unlogged.values(), key=lambda result: (result.version, result.server_id))
        self._unlogged.clear()
        for result in fresh:
            self._validations_logged[result.server_id] = result.version
        return [result.metrics | {VERSION_KEY: float(result.version)} for result in fresh]

    def wait_for_members(self, count: int, timeout_s: float) -> list[str]:
        """Block until `count` servers are live or the timeout passes; returns the live ones."""
        deadline = time.monotonic() + timeout_s
        while len(self.live_members()) < count and time.monotonic() < deadline:
            self._poll_until(deadline)
        return self.live_members()

    def broadcast(self, version: int, named_tensors: NamedTensors) -> RoundReport:
        """One round: every live server receives `named_tensors` as `version`, or is reported failed (and given
        up on after `max_failures` such rounds; WeightSyncFailed when that leaves none)."""
        report = self._run_round(version, named_tensors)
        self._record_outcome(report)
        return report

    def _run_round(self, version: int, named_tensors: NamedTensors) -> RoundReport:
        started = time.perf_counter()
        candidates = self._syncable()
        report = RoundReport(version=version, servers=len(candidates))
        self.latest_version = max(self.latest_version, version)
        if not candidates:
            return report
        self._round += 1
        invited = self._confirm_present(report, candidates)
        legs = self._legs(report, invited, named_tensors)
        update_info = update_info_for(named_tensors)
        for leg in legs:
            for name in leg.members:
                invite = SyncInvite(self._round, version, update_info, leg.init_infos.get(name, {}))
                self.socket.send_multipart([self.members[name].identity, encode(invite)])
        deadlines: dict[str, float] = {}
        for leg in legs:
            deadlines |= self._send(report, leg)
        self._collect(report, deadlines)
        for leg in legs:
            if any(name in report.failed for name in leg.members):
                self._close_group(leg.backend)  # a member may be stuck mid-broadcast: never reuse this group
        report.seconds = time.perf_counter() - started
        return report

    def _legs(self, report: RoundReport, invited: list[str], named_tensors: NamedTensors) -> list[_Leg]:
        """The round's part on each backend the `invited` servers receive on: the weights staged on it before any
        server is invited (and pauses), and a new group where its membership changed or the weights moved."""
        legs = []
        for backend, members in self._by_backend(report, invited).items():
            end = self._ends.end(backend)
            staged = end.stage(named_tensors)
            if staged.moved:  # every server on it must learn where the weights are now
                self._group_members[backend] = ()
            identities = tuple(self.members[name].identity for name in members)
            leg = _Leg(backend, end, members, identities, staged)
            if identities != self._group_members.get(backend, ()):
                leg.address, leg.init_infos = self._plan_group(leg)
            legs.append(leg)
        return legs

    def _by_backend(self, report: RoundReport, invited: list[str]) -> dict[str, list[str]]:
        """The `invited` servers by the backend each receives on; one naming no backend there is is reported failed."""
        by_backend: dict[str, list[str]] = {}
        for name in invited:
            try:
                backend = self._ends.backend_of(self.members[name].backend)
            except ValueError as error:
                report.failed[name] = f"weight backend: {error}"
                continue
            by_backend.setdefault(backend, []).append(name)
        return by_backend

    def _send(self, report: RoundReport, leg: _Leg) -> dict[str, float]:
        """Connect `leg`'s end where its group is new, and send; the deadline of each of its servers' reply: the
        round's `timeout_s`, or `liveness_s` when the transfer failed (its servers are reported failed, and a reply
        that one loaded after all still counts)."""
        try:
            if leg.address is not None:
                leg.end.connect(leg.address)
            self._group_members[leg.backend] = leg.identities
            report.transfer_seconds += leg.end.send(leg.staged)
        except WeightTransferError as error:
            log.warning("weight sync round %d (version %d) failed on %s: %s", self._round, report.version,
                        leg.backend, error)
            self._close_group(leg.backend)
            report.failed |= {name: f"transfer: {error}" for name in leg.members}
            if not error.retry_helps:
                report.hopeless.update(leg.members)
            return dict.fromkeys(leg.members, time.monotonic() + self.liveness_s)
        return dict.fromkeys(leg.members, time.monotonic() + self.timeout_s)

    def tell_servers(self, notice: object) -> list[str]:
        """Send `notice` (a control message) to every live server; the servers it went to."""
        live = self.live_members()
        for name in live:
            self.socket.send_multipart([self.members[name].identity, encode(notice)])
        return live

    def finish_job(self, version: int, timeout_s: float) -> list[str]:
        """Tell every live server that the job ended at `version`, again each `liveness_s`, until each has
        answered that it leaves or `timeout_s` passed; the servers that did not answer."""
        deadline = time.monotonic() + timeout_s
        while (live := self.tell_servers(JobFinished(version))) and time.monotonic() < deadline:
            self._poll_until(deadline)
        return live

    def _poll_until(self, deadline: float) -> None:
        """Wait for a message, at most until `deadline` and at most one `liveness_s` (a heartbeat's period)."""
        self.socket.poll(int(min(self.liveness_s, max(deadline - time.monotonic(), 0)) * MS_PER_S))

    def close(self) -> None:
        for backend in self._ends.in_use():
            self._close_group(backend)
        self._ends.close()
        self._router.close()

    def _plan_group(self, leg: _Leg) -> tuple[GroupAddress, dict[str, dict]]:
        """A fresh group for `leg`'s servers (on a port the OS picks unless `group_port` is set, held from now on), and
        each one's init request (its first rank)."""
        self._close_group(leg.backend)
        offsets, world_size = rank_layout([(name, self.members[name].ranks) for name in leg.members])
        address = leg.end.address(self.group_host, self.group_port, world_size, self.timeout_s)
        return address, {name: leg.end.init_info(address, offsets[name]) for name in leg.members}

    def _confirm_present(self, report: RoundReport, candidates: list[str]) -> list[str]:
        """The candidates that answer this round's `SyncPrepare` within `liveness_s` (at most `timeout_s`,
        the bound of every wait in a round); the others are reported failed and forgotten until they
        heartbeat again."""
        for name in candidates:
            self.socket.send_multipart([self.members[name].identity, encode(SyncPrepare(self._round))])
        waiting = set(candidates)
        wait_s = min(self.liveness_s, self.timeout_s)
        for reply in self._messages_until(time.monotonic() + wait_s, waiting):
            if isinstance(reply, SyncReady) and reply.round_id == self._round:
                waiting.discard(reply.server_id)
        self._forget_silent(report, waiting, f"no answer to the round's prepare within {wait_s:g}s")
        return [name for name in candidates if name not in waiting]

    def _forget_silent(self, report: RoundReport, silent: set[str], reason: str) -> None:
        for name in silent:
            report.failed.setdefault(name, reason)
            self.members.pop(name, None)  # silent: it must announce itself again

    def _collect(self, report: RoundReport, deadlines: dict[str, float]) -> None:
        """Gather SyncDone replies for this round until each server's arrived or its deadline passed (the servers
        silent until then are forgotten)."""
        waiting = dict(deadlines)
        while waiting:
            for reply in self._messages_until(min(waiting.values()), waiting):
                if isinstance(reply, SyncDone) and reply.round_id == self._round and reply.server_id in waiting:
                    del waiting[reply.server_id]
                    self._take_reply(report, reply)
            now = time.monotonic()
            silent = {name for name, deadline in waiting.items() if deadline <= now}
            self._forget_silent(report, silent, "no reply before the deadline")
            waiting = {name: deadline for name, deadline in waiting.items() if name not in silent}

    def _take_reply(self, report: RoundReport, reply: SyncDone) -> None:
        """A server's answer to this round's invite, into `report` (and its member's version when it loaded)."""
        if reply.ok:
            member = self.members.get(reply.server_id)
            if member is not None:
                member.version, member.needs_catch_up = report.version, False
            report.succeeded.append(reply.server_id)
            report.failed.pop(reply.server_id, None)
            report.hopeless.discard(reply.server_id)
            report.max_server_pause_s = max(report.max_server_pause_s, reply.seconds)
        else:
            report.failed[reply.server_id] = reply.error
            if not reply.retry_helps:
                report.hopeless.add(reply.server_id)

    def _messages_until(self, deadline: float, waiting: Collection[str]) -> Iterator[object]:
        """Messages as they arrive (heartbeats and telemetry are taken in on the way) while `waiting`, which the caller
        empties, still names a server and the deadline has not passed."""
        while waiting and time.monotonic() < deadline:
            if not self.socket.poll(int(max(deadline - time.monotonic(), 0) * MS_PER_S)):
                return
            yield self._receive_one()

    def _drain(self) -> None:
        while self.socket.poll(0):
            self._receive_one()

    def _receive_one(self) -> object:
        identity, frame = self.socket.recv_multipart()[:2]
        try:
            msg = decode(frame)
        except DecodeError as error:
            log.warning("dropping an undecodable weight-sync frame: %s", error)
            return None
        if isinstance(msg, ServerHeartbeat):
            known = self.members.get(msg.server_id)
            if known is None:
                log.info("rollout server %s joined weight sync (version %d, weights by %s)", msg.server_id, msg.version,
                         msg.backend or self._ends.default)
            version = msg.version
            if known is not None and known.identity == identity:
                # same process: a heartbeat queued before the last round must not undo what it loaded
                version = max(version, known.version)
            self.members[msg.server_id] = Member(identity, msg.ranks, time.monotonic(), version, msg.needs_catch_up,
                                                 msg.backend)
            self._identities[msg.server_id] = identity
        elif isinstance(msg, ServerTelemetry):
            self._telemetry[msg.server_id] = (time.monotonic(), msg)
        elif isinstance(msg, ValidationResult):
            self._keep_pass(msg)
        elif isinstance(msg, ServerLeaving) and self.members.pop(msg.server_id, None) is not None:
            log.info("rollout server %s left: the job is finished", msg.server_id)
        return msg

    def _keep_pass(self, result: ValidationResult) -> None:
        """Hold a pass until `new_validations` returns it: servers repeat their latest passes in every report."""
        if result.metrics and result.version > self._validations_logged.get(result.server_id, NOT_VALIDATED):
            self._unlogged[(result.server_id, result.version)] = result

    def _close_group(self, backend: str) -> None:
        self._ends.disconnect(backend)
        self._group_members[backend] = ()


def _heard_within(latest: dict[str, tuple[float, ServerTelemetry]], seconds: float) -> list[ServerTelemetry]:
    """The latest report of each server heard from within `seconds`, by server name."""
    now = time.monotonic()
    return [report for _, (received, report) in sorted(latest.items()) if now - received <= seconds]


def rank_layout(servers: list[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """Each server's first group rank (the trainer is rank 0; a server takes one rank per worker) and
    the world size."""
    offsets, next_rank = {}, _FIRST_SERVER_RANK
    for name, ranks in servers:
        offsets[name] = next_rank
        next_rank += ranks
    return offsets, next_rank

