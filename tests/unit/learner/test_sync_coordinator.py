"""Weight-sync rounds without vLLM: fake servers on real ZeroMQ sockets and a real gloo group."""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import zmq

from asyncrl.messages import decode, encode
from asyncrl.transport import generate_curve_keys
from asyncrl.transport.sockets import connect_dealer
from asyncrl.weight_transfer import parse_update_info, weight_backend
from asyncrl.weight_transfer.backends import GLOO
from asyncrl.weight_transfer.ipc_backend import IpcSendingEnd
from asyncrl.weight_transfer.control_messages import (JobFinished, ServerHeartbeat, ServerLeaving, ServerTelemetry, SyncDone,
                                                      SyncPrepare, SyncReady, ValidationResult)
from learner.weight_sync.coordinator import SyncCoordinator, WeightSyncFailed, rank_layout
from learner.weight_sync.sending_ends import SendingEnds
from asyncrl.weight_transfer.ipc import SharedWeightsReader
from asyncrl.weight_transfer.group import GroupAddress, WeightTransferError, retry_helps
from asyncrl.weight_transfer.interface import SendingEnd, Staged
from asyncrl.weight_transfer.protocol import InitInfo, init_info_for
from tests.unit.asyncrl.test_weight_backends import CpuSharedWeights
from waiting import wait_until

CPU = torch.device("cpu")
TIMEOUT_S = 10.0  # generous: a gloo rendezvous on a loaded 2-core box can take seconds
LIVENESS_S = 1.0
HEARTBEAT_S = 0.05


class FakeServer(threading.Thread):
    """Heartbeats; answers each prepare; on each invite (re)joins the group if asked, receives every
    tensor, reports. A server with `answer=False` heartbeats and ignores everything else; one with `fail_with`
    receives and then reports that error (one no retry can fix where `hopeless`)."""

    def __init__(self, name: str, address: str, answer: bool = True, fail_with: str = "", curve_dir: str = "",
                 backend: str = "", hopeless: bool = False) -> None:
        super().__init__(daemon=True)
        self.name_, self.address, self.answer, self.fail_with = name, address, answer, fail_with
        self.hopeless = hopeless
        self.curve_dir = curve_dir  # CURVE client keys to connect with ("" = none)
        self.backend = backend  # the weight backend its heartbeats announce ("" = the learner's default)
        self.received: dict[int, dict[str, torch.Tensor]] = {}
        self.stop = threading.Event()
        self.version = 0
        self.finished_at: int | None = None  # the final version of a JobFinished it answered
        self.joins = 0  # init requests received (a group joined, or a shared buffer mapped)

    def run(self) -> None:
        sock = connect_dealer(zmq.Context.instance(), self.address, self.curve_dir)
        weights = None  # the receiving end of the latest init request
        while not self.stop.is_set():
            sock.send(encode(ServerHeartbeat(self.name_, 1, self.version, backend=self.backend)))
            if not sock.poll(int(HEARTBEAT_S * 1000)):
                continue
            message = decode(sock.recv())
            if not self.answer:
                continue
            if isinstance(message, SyncPrepare):
                sock.send(encode(SyncReady(self.name_, message.round_id)))
                continue
            if isinstance(message, JobFinished):
                sock.send(encode(ServerLeaving(self.name_)))
                self.finished_at = message.version
                break
            invite = message
            try:
                if invite.init_info:
                    info = InitInfo(**invite.init_info)
                    self.joins += 1
                    weights = (SharedWeightsReader(CpuSharedWeights.buffers[info.ipc["handle"]]) if info.backend == "ipc"
                               else weight_backend(info.backend).receiving_end(info, info.rank_offset, CPU))
                tensors = {name: tensor.clone() for name, tensor in weights.tensors(parse_update_info(invite.update_info))}
                if self.fail_with:  # a server that takes part in the transfer but fails to load, every time
                    raise WeightTransferError(self.fail_with, retry_helps=not self.hopeless)
            except Exception as error:  # as a real server does: report, stay, catch up next round
                sock.send(encode(SyncDone(self.name_, invite.round_id, ok=False, error=str(error),
                                          retry_helps=retry_helps(error))))
                continue
            self.received[invite.version], self.version = tensors, invite.version
            sock.send(encode(SyncDone(self.name_, invite.round_id, ok=True, seconds=0.01)))
        sock.close(0)


def sending_ends(default: str = "gloo", staging_bytes: int = 0, ipc: SendingEnd | None = None) -> SendingEnds:
    """The learner's ends: gloo's real one (with `staging_bytes`) and, for servers on ipc, `ipc` (default: the ipc
    end over the CPU stand-in of its buffer); a server announcing no backend gets `default`'s."""
    made = {"gloo": lambda: GLOO.sending_end(staging_bytes), "ipc": lambda: ipc or IpcSendingEnd(CpuSharedWeights())}
    return SendingEnds(default, lambda name: made[name]())


def coordinator(staging_bytes: int = 0, max_failures: int = 3, ends: SendingEnds | None = None,
                timeout_s: float = TIMEOUT_S, liveness_s: float = LIVENESS_S, bind: str = "tcp://127.0.0.1:0",
                curve_dir: str = "") -> SyncCoordinator:
    """A coordinator sending through `ends` (default: gloo's sending end with `staging_bytes`)."""
    return SyncCoordinator(bind, "127.0.0.1", 0, ends or sending_ends(staging_bytes=staging_bytes), timeout_s,
                           liveness_s=liveness_s, max_failures=max_failures, curve_dir=curve_dir)


@contextmanager
def serving(coord: SyncCoordinator, *servers: FakeServer, joined: bool = True) -> Iterator[None]:
    """The servers running against `coord` for the block, each a member of its weight sync before the block starts
    (`joined`; else the block waits for what it expects); all stopped and the coordinator closed after."""
    for server in servers:
        server.start()
    try:
        if joined:
            coord.wait_for_members(len(servers), timeout_s=10)
        yield
    finally:
        for server in servers:
            server.stop.set()
        coord.close()


def weights(scale: float) -> list[tuple[str, torch.Tensor]]:
    # the middle one is a transposed view, as some state-dict entries are: it must arrive laid out as its shape says
    return [("a.weight", torch.full((3, 2), scale)), ("b.weight", (torch.arange(6.0).reshape(2, 3) * scale).t()),
            ("lm_head.weight", torch.arange(4.0) * scale)]


def test_rank_layout_gives_each_server_consecutive_ranks_after_the_trainer():
    assert rank_layout([("s0", 2), ("s1", 2), ("s2", 1)]) == ({"s0": 1, "s1": 3, "s2": 5}, 6)


@pytest.mark.parametrize("staging_bytes", [0, 24, 1 << 20], ids=["unstaged", "first-staged", "all-staged"])
def test_rounds_deliver_weights_and_reuse_the_group_while_membership_holds(staging_bytes):
    coord = coordinator(staging_bytes)
    servers = [FakeServer(f"s{i}", coord.address) for i in range(2)]
    with serving(coord, *servers, joined=False):
        assert coord.wait_for_members(2, timeout_s=10) == ["s0", "s1"]
        for version, scale in ((1, 1.0), (2, -3.0)):
            report = coord.broadcast(version, weights(scale))
            assert sorted(report.succeeded) == ["s0", "s1"] and not report.failed
            for server in servers:
                got = server.received[version]
                assert all(torch.equal(got[name], tensor) for name, tensor in weights(scale))
        assert coord.lagging_members(2) == []
        assert coord.lagging_members(3) == ["s0", "s1"]


def test_a_server_restarted_under_the_same_name_is_given_a_new_group():
    coord = coordinator()
    first = FakeServer("s0", coord.address)
    first.start()
    try:
        coord.wait_for_members(1, timeout_s=10)
        assert coord.broadcast(1, weights(1.0)).succeeded == ["s0"]
        first_identity = coord.members["s0"].identity
        first.stop.set()
        first.join()
        restarted = FakeServer("s0", coord.address)  # a new process: a new socket, not in the old group
        restarted.start()

        def restart_heard() -> bool:
            coord.live_members()  # takes its heartbeats in
            return coord.members["s0"].identity != first_identity

        wait_until(restart_heard, TIMEOUT_S, "a heartbeat of the restarted server")
        report = coord.broadcast(2, weights(2.0))
        assert report.succeeded == ["s0"] and not report.failed, report
        assert torch.equal(restarted.received[2]["a.weight"], torch.full((3, 2), 2.0))
    finally:
        first.stop.set()
        restarted.stop.set()
        coord.close()


def test_the_end_of_the_job_reaches_each_server_and_waits_for_it_to_leave():
    coord = coordinator()
    leaving, silent = FakeServer("leaving", coord.address), FakeServer("silent", coord.address, answer=False)
    with serving(coord, leaving, silent):
        started = time.monotonic()
        assert coord.finish_job(7, timeout_s=2 * LIVENESS_S) == ["silent"]  # it keeps heartbeating, never answers
        assert time.monotonic() - started < TIMEOUT_S
        leaving.join(TIMEOUT_S)
        assert leaving.finished_at == 7 and "leaving" not in coord.members


def test_ipc_rounds_write_the_shared_buffer_before_the_invite_and_map_it_once():
    """Backend ipc: each server maps the buffer at its first round only, reads each round's weights from it (so they
    were written before the invitation), and maps it again when the weights outgrow it."""
    coord = coordinator(ends=sending_ends(default="ipc"))
    servers = [FakeServer(f"s{i}", coord.address) for i in range(2)]
    with serving(coord, *servers):
        for version, scale in ((1, 1.0), (2, -3.0)):
            report = coord.broadcast(version, weights(scale))
            assert sorted(report.succeeded) == ["s0", "s1"] and not report.failed
            for server in servers:
                assert all(torch.equal(server.received[version][name], tensor) for name, tensor in weights(scale))
        assert [server.joins for server in servers] == [1, 1]
        larger = weights(5.0) + [("extra.weight", torch.ones(1000))]
        report = coord.broadcast(3, larger)
        assert sorted(report.succeeded) == ["s0", "s1"]
        assert [server.joins for server in servers] == [2, 2]
        assert torch.equal(servers[0].received[3]["extra.weight"], torch.ones(1000))


class LostBuffer(SendingEnd):
    """An ipc end whose buffer is gone: its init requests name a handle no server can map, and connecting fails (in a
    way no retry can fix unless `retry_helps`)."""

    def __init__(self, retry_helps: bool = True) -> None:
        self.retry_helps = retry_helps

    def stage(self, named_tensors) -> Staged:
        return Staged([])

    def address(self, host: str, port: int, world_size: int, timeout_s: float) -> GroupAddress:
        return GroupAddress(host, 0, world_size, "ipc", timeout_s)

    def init_info(self, address: GroupAddress, rank_offset: int) -> dict:
        return init_info_for(address, rank_offset, {"handle": "lost"})

    def connect(self, address: GroupAddress) -> None:
        raise WeightTransferError("the shared buffer is gone", self.retry_helps)

    def send(self, staged: Staged) -> float:
        raise AssertionError("never sent: connecting failed")


def test_one_round_reaches_servers_on_two_backends_each_through_its_own_end():
    """A server beside the learner announces ipc, two on GPUs of their own gloo (NCCL's CPU stand-in): every round
    each gets the exact weights and version, the ipc write counts in the transfer time, and each end keeps its
    servers across rounds (one init request each)."""
    coord = coordinator()
    beside = FakeServer("beside", coord.address, backend="ipc")
    apart = [FakeServer(f"apart{i}", coord.address, backend="gloo") for i in range(2)]
    with serving(coord, beside, *apart):
        for version, scale in ((1, 1.0), (2, -3.0)):
            report = coord.broadcast(version, weights(scale))
            assert sorted(report.succeeded) == ["apart0", "apart1", "beside"] and not report.failed
            assert report.transfer_seconds >= CpuSharedWeights.WRITE_S  # the ipc leg's write, plus gloo's broadcast
            for server in (beside, *apart):
                got = server.received[version]
                assert list(got) == [name for name, _ in weights(scale)]
                assert all(torch.equal(got[name], tensor) for name, tensor in weights(scale))
                assert server.version == version
        assert [server.joins for server in (beside, *apart)] == [1, 1, 1]
        assert coord.lagging_members(2) == []


def test_a_failure_on_one_backend_fails_its_servers_only():
    coord = coordinator(ends=sending_ends(ipc=LostBuffer()))
    beside = FakeServer("beside", coord.address, backend="ipc")
    apart = [FakeServer(f"apart{i}", coord.address, backend="gloo") for i in range(2)]
    with serving(coord, beside, *apart):
        for version in (1, 2):
            report = coord.broadcast(version, weights(float(version)))
            assert sorted(report.succeeded) == ["apart0", "apart1"] and list(report.failed) == ["beside"]
            for server in apart:
                assert torch.equal(server.received[version]["a.weight"], torch.full((3, 2), float(version)))
            assert version not in beside.received
            wait_until(lambda: "beside" in coord.live_members(), TIMEOUT_S, "the failed server heard again",
                       poll_s=HEARTBEAT_S)
        assert [server.joins for server in apart] == [1, 1], "the gloo group outlived the ipc leg's failures"
        assert coord.lagging_members(2) == ["beside"]
        assert (coord.members["apart0"].version, coord.members["beside"].version) == (2, 0)


def test_a_transfer_that_no_retry_can_fix_gives_up_on_its_servers_at_once_and_serves_the_others(caplog):
    coord = coordinator(max_failures=100, ends=sending_ends(ipc=LostBuffer(retry_helps=False)))
    beside = FakeServer("beside", coord.address, backend="ipc")
    apart = FakeServer("apart", coord.address, backend="gloo")
    with serving(coord, beside, apart):
        report = coord.broadcast(1, weights(1.0))
        assert report.hopeless == {"beside"}
        assert "giving up on beside" in caplog.text and "an error no retry can fix" in caplog.text
        report = coord.broadcast(2, weights(2.0))
        assert report.succeeded == ["apart"] and not report.failed  # the first failure was its last round


def test_a_server_announcing_an_unknown_backend_is_failed_and_the_others_served():
    coord = coordinator()
    good, odd = FakeServer("good", coord.address), FakeServer("odd", coord.address, backend="carrier-pigeon")
    with serving(coord, good, odd):
        report = coord.broadcast(1, weights(1.0))
        assert report.succeeded == ["good"]
        assert report.failed == {"odd": "weight backend: unknown weight-sync backend 'carrier-pigeon': choose one of "
                                        "gloo, nccl, ipc, auto"}


def test_a_silent_server_is_left_out_of_the_round_within_liveness_and_is_dropped():
    coord = coordinator()
    good, silent = FakeServer("good", coord.address), FakeServer("silent", coord.address, answer=False)
    with serving(coord, good, silent):
        started = time.monotonic()
        report = coord.broadcast(1, weights(1.0))
        # it costs the prepare's wait (liveness_s), not the rendezvous deadline (a group that waits for it
        # fails after TIMEOUT_S), and the good server still gets the weights: the group is built of the
        # servers that answered
        assert time.monotonic() - started < TIMEOUT_S
        assert "silent" in report.failed and report.succeeded == ["good"]
        assert torch.equal(good.received[1]["a.weight"], torch.full((3, 2), 1.0))
        silent.stop.set()
        silent.join()
        # liveness counts from when a heartbeat is read: reading them all along, the stopped server drops out
        # liveness_s after its last one arrived (none still queued could look fresh to the next round)
        wait_until(lambda: coord.live_members() == ["good"], LIVENESS_S + TIMEOUT_S, "the silent server dropped",
                   poll_s=HEARTBEAT_S)
        report = coord.broadcast(2, weights(2.0))
        assert report.succeeded == ["good"] and not report.failed
        assert torch.equal(good.received[2]["a.weight"], torch.full((3, 2), 2.0))


def test_the_prepare_waits_no_longer_than_the_rounds_deadline():
    coord = coordinator(timeout_s=1.0, liveness_s=60.0)
    silent = FakeServer("silent", coord.address, answer=False)
    with serving(coord, silent):
        started = time.monotonic()
        report = coord.broadcast(1, weights(1.0))
        assert "silent" in report.failed and not report.succeeded
        assert time.monotonic() - started < 30.0  # bounded by timeout_s (1 s), not liveness_s (60 s)


def test_no_servers_means_an_empty_round_not_a_wait():
    coord = coordinator()
    try:
        started = time.monotonic()
        report = coord.broadcast(1, weights(1.0))
        assert report.servers == 0 and time.monotonic() - started < 0.5
    finally:
        coord.close()


def test_every_validation_pass_is_returned_once_in_version_order():
    coord = coordinator()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(coord.address)

    reports = iter(range(1, 100))

    def report(*passes: ValidationResult) -> list[dict[str, float]]:
        """What one learner call returns once the coordinator read the telemetry sent after these passes (the same
        socket keeps the order, so every pass before it was read too; each report's telemetry has a version of its
        own). Only the telemetry is polled: a call while the passes are still arriving could split them between two
        reads, which is no longer one read of passes sent out of order."""
        version = next(reports)
        for result in passes:
            sock.send(encode(result))
        sock.send(encode(ServerTelemetry("s0", version)))
        wait_until(lambda: coord.rollout_metrics(100).get("rollout/s0/version_lag") == 100 - version, TIMEOUT_S,
                   f"the telemetry of version {version}", poll_s=HEARTBEAT_S)
        return coord.new_validations()

    def score(version: int) -> ValidationResult:
        return ValidationResult("s0", version, {"val/score/mean": version / 100, "val/pass@4": 0.5})

    try:
        assert report() == []
        assert report(score(0)) == [{"val/score/mean": 0.0, "val/pass@4": 0.5, "val/version": 0.0}]
        assert report(score(0)) == [], "the same pass, heard again: not returned twice"
        # three passes between two reads (a server repeats its latest passes): each returned, oldest first
        returned = report(score(0), score(20), score(10), score(30))
        assert [(r["val/version"], r["val/score/mean"]) for r in returned] == [(10.0, 0.1), (20.0, 0.2), (30.0, 0.3)]
        assert report(score(20), score(30)) == []
    finally:
        sock.close(0)
        coord.close()


def test_a_server_that_keeps_failing_is_given_up_on_and_the_others_go_on(caplog):
    coord = coordinator(max_failures=2)
    good, broken = FakeServer("good", coord.address), FakeServer("broken", coord.address, fail_with="out of memory")
    with serving(coord, good, broken):
        assert "broken" in coord.broadcast(1, weights(1.0)).failed
        assert "broken" in coord.broadcast(2, weights(2.0)).failed  # the second in a row: given up
        assert "giving up on broken" in caplog.text and "rollout.weight_sync.max_failures" in caplog.text
        report = coord.broadcast(3, weights(3.0))
        assert report.succeeded == ["good"] and not report.failed  # no longer invited
        assert coord.lagging_members(4) == ["good"]  # nor caught up


def test_a_failure_that_says_a_retry_may_help_is_retried_whatever_its_text():
    coord = coordinator(max_failures=2)
    broken = FakeServer("broken", coord.address, fail_with="ncclInvalidUsage: Duplicate GPU detected: rank 1 and rank 0")
    with serving(coord, broken):
        assert not coord.broadcast(1, weights(1.0)).hopeless  # the flag decides, not NCCL's words in the error
        with pytest.raises(WeightSyncFailed, match="Duplicate GPU"):  # max_failures rounds in a row
            coord.broadcast(2, weights(2.0))


def test_an_error_no_retry_can_fix_ends_the_sync_at_once_when_no_server_is_left():
    coord = coordinator(max_failures=100)
    broken = FakeServer("broken", coord.address, fail_with="ncclInvalidUsage: Duplicate GPU detected: rank 1 and rank 0",
                        hopeless=True)
    with serving(coord, broken):
        started = time.monotonic()
        with pytest.raises(WeightSyncFailed, match="Duplicate GPU"):
            coord.broadcast(1, weights(1.0))
        assert time.monotonic() - started < TIMEOUT_S  # the first round, not max_failures of them


def test_a_restarted_server_is_taken_again():
    coord = coordinator(max_failures=1)
    broken = FakeServer("s0", coord.address, fail_with="out of memory")
    restarted = FakeServer("s0", coord.address)  # same name, a new process (a new socket identity)
    with serving(coord, broken):
        with pytest.raises(WeightSyncFailed):
            coord.broadcast(1, weights(1.0))
        broken.stop.set()
        broken.join()
        with serving(coord, restarted, joined=False):  # its name is a member already: wait for it to lag instead
            wait_until(lambda: coord.lagging_members(1) == ["s0"], TIMEOUT_S, "the restarted server taken again",
                       poll_s=HEARTBEAT_S)
            assert coord.broadcast(1, weights(1.0)).succeeded == ["s0"]


# "lo" names the loopback interface: the CURVE rule cannot tell it is loopback, so it applies in full
# (as to a node's address under Ray), while every byte of the test stays on 127.0.0.1
NON_LOOPBACK_LOOKING_BIND = "tcp://lo:0"


def test_a_non_loopback_bind_without_keys_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"non-loopback.*buffer\.curve_dir"):
        coordinator(bind=NON_LOOPBACK_LOOKING_BIND)


def test_on_a_non_loopback_bind_only_servers_holding_the_jobs_key_join_weight_sync(tmp_path):
    keys, other_keys = generate_curve_keys(tmp_path / "keys"), generate_curve_keys(tmp_path / "other")
    # the impostor knows the coordinator's public key; its own client key is a valid one nobody authorised
    shutil.copy(keys / "server.key", other_keys / "server.key")
    coord = coordinator(bind=NON_LOOPBACK_LOOKING_BIND, curve_dir=str(keys))
    member = FakeServer("member", coord.address, curve_dir=str(keys))
    keyless = FakeServer("keyless", coord.address)
    impostor = FakeServer("impostor", coord.address, curve_dir=str(other_keys))
    with serving(coord, member, keyless, impostor, joined=False):  # only the member may join
        assert coord.wait_for_members(1, timeout_s=10) == ["member"]
        # the intruders heartbeat every HEARTBEAT_S all along: many tries, none of which may get through
        deadline = time.monotonic() + 2 * LIVENESS_S
        while time.monotonic() < deadline:
            assert coord.live_members() == ["member"]
            time.sleep(HEARTBEAT_S)  # the behaviour under test: no intruder gets in over 2 * liveness_s
        report = coord.broadcast(1, weights(1.0))
        assert report.servers == 1 and report.succeeded == ["member"] and not report.failed
        assert not keyless.received and not impostor.received
