"""The weight-transfer group over NCCL between two processes on two GPUs: reliable rendezvous, exact data,
and clear errors within the deadline when a peer is missing or dies mid-round (never a hang)."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from asyncrl.net import free_port
from asyncrl.weight_transfer import GroupAddress, WeightTransferError
from asyncrl.weight_transfer.backends import NCCL
from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

SPAWN = multiprocessing.get_context("spawn")
HOST = "127.0.0.1"
DEADLINE_S = 5.0  # rendezvous and transfer deadline of each group
SLACK_S = 3.0  # process start-up and polling on top of the deadline
JOINS = 10  # consecutive rendezvous of the reliability test (a hang in 3 of 4 was seen before the fix)
TRAINER_DEVICE, WORKER_DEVICE = 1, 0  # the learner's GPU and the rollout server's
RESULT_WAIT_S = 120  # no child may make the test hang


def address(world_size: int) -> GroupAddress:
    return GroupAddress(HOST, free_port(), world_size=world_size, backend="nccl", timeout_s=DEADLINE_S)


def payload(device: int) -> list[torch.Tensor]:
    """What the trainer sends: bf16 and fp32 tensors of odd sizes, derived from a fixed seed."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(896, 896), (151, 7), (4864,)]
    return [torch.randn(shape, generator=generator).to(dtype).cuda(device)
            for shape, dtype in zip(shapes, [torch.bfloat16, torch.float32, torch.bfloat16])]


def member(rank: int, where: GroupAddress, device: int, joins: int, send: bool, results) -> None:
    """Join `joins` times; each time receive (or send) the payload and report timings or the error."""
    prepare_nccl_environment(where.host)
    torch.cuda.set_device(device)
    expected = payload(device)
    try:
        for attempt in range(joins):
            at = GroupAddress(where.host, where.port + attempt, where.world_size, where.backend, where.timeout_s)
            started = time.monotonic()
            group = NCCL.join(at, rank, torch.device("cuda", device))
            joined_s = time.monotonic() - started
            tensors = expected if rank == 0 else [torch.empty_like(t) for t in expected]
            if send:
                for tensor in tensors:
                    group.broadcast(tensor)
                group.synchronize()
            equal = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(tensors, expected))
            results.put((rank, "ok", joined_s, equal))
            group.close()
    except WeightTransferError as error:
        results.put((rank, "error", time.monotonic() - started, str(error)))


def start(rank: int, where: GroupAddress, device: int, joins: int = 1, send: bool = True, results=None):
    process = SPAWN.Process(target=member, args=(rank, where, device, joins, send, results), daemon=True)
    process.start()
    return process


def collect(results, count: int) -> list[tuple]:
    return [results.get(timeout=RESULT_WAIT_S) for _ in range(count)]


def consecutive_ports(joins: int) -> int:
    """A base port whose next `joins` ports are free now (each rendezvous uses its own)."""
    while True:
        base = free_port()
        if all(_port_free(base + offset) for offset in range(joins)):
            return base


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def test_rendezvous_and_transfer_are_reliable_and_exact():
    results = SPAWN.Queue()
    where = GroupAddress(HOST, consecutive_ports(JOINS), 2, "nccl", DEADLINE_S)
    processes = [start(0, where, TRAINER_DEVICE, JOINS, results=results),
                 start(1, where, WORKER_DEVICE, JOINS, results=results)]
    reports = collect(results, 2 * JOINS)
    for process in processes:
        process.join(RESULT_WAIT_S)
    assert [status for _, status, *_ in reports] == ["ok"] * (2 * JOINS), reports
    assert all(equal for *_, equal in reports)  # every received tensor equals the sent one bit for bit
    assert max(seconds for _, _, seconds, _ in reports) < DEADLINE_S


def test_missing_worker_fails_within_the_deadline():
    results = SPAWN.Queue()
    where = address(world_size=3)  # the trainer waits for two workers; only one comes
    processes = [start(0, where, TRAINER_DEVICE, results=results), start(1, where, WORKER_DEVICE, results=results)]
    reports = collect(results, 2)
    for process in processes:
        process.join(RESULT_WAIT_S)
    for rank, status, seconds, error in reports:
        assert status == "error", (rank, error)
        assert "members joined" in error or "gave up" in error
        assert seconds < DEADLINE_S + SLACK_S


def test_trainer_that_never_sends_ends_the_round_within_the_deadline():
    results = SPAWN.Queue()
    where = address(world_size=2)
    trainer = start(0, where, TRAINER_DEVICE, send=False, results=results)  # joins, then announces nothing
    worker = start(1, where, WORKER_DEVICE, send=True, results=results)  # waits for tensors that never come
    reports = dict((rank, (status, seconds, detail)) for rank, status, seconds, detail in collect(results, 2))
    for process in (trainer, worker):
        process.join(RESULT_WAIT_S)
    status, seconds, detail = reports[1]
    assert status == "error" and "did not complete within" in detail, detail
    assert seconds < DEADLINE_S * 2 + SLACK_S  # join (well under one deadline) plus the round's deadline
