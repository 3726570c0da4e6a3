"""A mixed plan's weight sync on two GPUs: the learner's coordinator on GPU 0 sends each round to a server beside
it (GPU 0, CUDA IPC) and to a server on GPU 1 (NCCL) through the real sending ends, and both read the exact
tensors of every version. Each fake server is a process of its own, as a rollout server is."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import zmq

from asyncrl.messages import decode, encode
from asyncrl.transport.sockets import connect_dealer
from asyncrl.weight_transfer import parse_update_info, weight_backend
from asyncrl.weight_transfer.control_messages import ServerHeartbeat, SyncDone, SyncInvite, SyncPrepare, SyncReady
from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment
from asyncrl.weight_transfer.protocol import InitInfo
from learner.weight_sync.coordinator import SyncCoordinator
from learner.weight_sync.sending_ends import SendingEnds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

SPAWN = multiprocessing.get_context("spawn")
WAIT_S = 120  # no child may make the test hang
HEARTBEAT_S = 0.05
STAGING_BYTES = 1 << 30  # the round is staged on the learner's GPU for NCCL too


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """bf16 and fp32 tensors on the learner's GPU whose values change every version (a transposed view among them)."""
    generator = torch.Generator().manual_seed(version)
    return [("embed.weight", torch.randn(151, 7, generator=generator).to(torch.bfloat16).cuda(0)),
            ("proj.weight", torch.randn(33, 17, generator=generator).cuda(0).t()),
            ("norm.weight", torch.randn(4864, generator=generator).to(torch.bfloat16).cuda(0))]


def fake_server(name: str, address: str, backend: str, gpu: int, results, stop) -> None:
    """Heartbeat naming `backend`; answer each prepare; on each invite (re)join as its init request says, read every
    tensor onto `gpu`, put (name, version, backend joined, CPU copies) on `results`, and report."""
    torch.cuda.set_device(gpu)
    sock = connect_dealer(zmq.Context.instance(), address, "")
    end, joined, version = None, "", 0
    while not stop.is_set():
        sock.send(encode(ServerHeartbeat(name, 1, version, backend=backend)))
        if not sock.poll(int(HEARTBEAT_S * 1000)):
            continue
        message = decode(sock.recv())
        if isinstance(message, SyncPrepare):
            sock.send(encode(SyncReady(name, message.round_id)))
            continue
        if not isinstance(message, SyncInvite):
            continue
        try:
            if message.init_info:
                info = InitInfo(**message.init_info)
                end = weight_backend(info.backend).receiving_end(info, info.rank_offset, torch.device("cuda", gpu), end)
                joined = info.backend
            read = {tensor_name: tensor.cpu() for tensor_name, tensor in end.tensors(parse_update_info(message.update_info))}
            end.synchronize()
        except Exception as error:  # reported as a real server does
            sock.send(encode(SyncDone(name, message.round_id, ok=False, error=str(error))))
            continue
        version = message.version
        results.put((name, version, joined, read))
        sock.send(encode(SyncDone(name, message.round_id, ok=True, seconds=0.0)))
    sock.close(0)


def test_a_round_reaches_the_server_beside_the_learner_by_ipc_and_the_one_apart_by_nccl():
    prepare_nccl_environment("127.0.0.1")
    torch.cuda.set_device(0)
    ends = SendingEnds("auto", lambda backend: weight_backend(backend).sending_end(STAGING_BYTES))
    coord = SyncCoordinator("tcp://127.0.0.1:0", "127.0.0.1", 0, ends, timeout_s=60.0, liveness_s=5.0)
    results, stop = SPAWN.Queue(), SPAWN.Event()
    children = [SPAWN.Process(target=fake_server, args=("beside", coord.address, "ipc", 0, results, stop)),
                SPAWN.Process(target=fake_server, args=("apart", coord.address, "nccl", 1, results, stop))]
    for child in children:
        child.start()
    try:
        assert coord.wait_for_members(2, timeout_s=WAIT_S) == ["apart", "beside"]
        for version in (1, 2, 3):
            report = coord.broadcast(version, weights(version))
            assert sorted(report.succeeded) == ["apart", "beside"] and not report.failed
            read = {name: (got_version, joined, tensors)
                    for name, got_version, joined, tensors in (results.get(timeout=WAIT_S) for _ in range(2))}
            assert {name: joined for name, (_, joined, _) in read.items()} == {"beside": "ipc", "apart": "nccl"}
            for got_version, _, tensors in read.values():
                assert got_version == version
                assert all(torch.equal(tensors[name], tensor.cpu()) for name, tensor in weights(version))
        assert sorted(ends.in_use()) == ["ipc", "nccl"]
    finally:
        stop.set()
        for child in children:
            child.join(WAIT_S)
            if child.is_alive():
                child.kill()
        coord.close()
