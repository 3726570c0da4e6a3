"""The weight backends behind one interface: how a name becomes a backend, where each works, and their ends as
the coordinator drives them (a gloo round trip; the ipc end with a CPU stand-in for its CUDA buffer)."""

from __future__ import annotations

import dataclasses
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asyncrl.config.fields import CHOICES_KEY
from asyncrl.config.rollout import WeightSyncConfig
from asyncrl.weight_transfer import GroupAddress, parse_update_info, update_info_for
from asyncrl.weight_transfer.backends import AUTO, BACKENDS, GLOO, IPC, NCCL, group_backend, weight_backend
from asyncrl.weight_transfer import ipc
from asyncrl.weight_transfer.collectives import GlooCollectives, NcclCollectives
from asyncrl.weight_transfer.group import WeightTransferError, retry_helps
from asyncrl.weight_transfer.ipc import OTHER_GPU, IpcHandle, SharedWeightsReader, byte_layout, pack_into
from asyncrl.weight_transfer.ipc_backend import IpcSendingEnd
from asyncrl.weight_transfer.kinds import KINDS, alternatives
from asyncrl.weight_transfer.protocol import InitInfo

CPU = torch.device("cpu")
WEIGHTS = [("a.weight", torch.full((3, 2), 1.5)), ("b.bias", torch.arange(4.0)),
           ("c.view", torch.arange(6.0).reshape(2, 3).t())]  # a view among them: sent as laid out by its shape


def test_the_config_offers_every_backend_and_auto():
    choices = {field.name: field.metadata.get(CHOICES_KEY) for field in dataclasses.fields(WeightSyncConfig)}["backend"]
    assert set(choices) == {*BACKENDS, AUTO}


def cuda_seen(monkeypatch, gpus: int) -> None:
    """This process sees `gpus` GPUs, as NVML counts them; asking `torch.cuda.is_available()` fails the test: it
    initializes CUDA's driver, and the synchronous reference asks before vLLM forks its engine core from it."""
    def initializes_cuda() -> bool:
        raise AssertionError("torch.cuda.is_available() initializes CUDA: a forked engine core could not use it")

    monkeypatch.setattr(torch.cuda, "is_available", initializes_cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)


def test_auto_is_nccl_with_cuda_else_gloo_and_a_plan_with_a_shared_gpu_makes_it_ipc(monkeypatch):
    cuda_seen(monkeypatch, 1)
    assert weight_backend(AUTO) is NCCL
    cuda_seen(monkeypatch, 0)
    assert weight_backend(AUTO) is GLOO
    assert weight_backend(AUTO, shared_gpu=True) is IPC and weight_backend(AUTO, shared_gpu=False) is NCCL
    assert weight_backend("gloo", shared_gpu=True) is GLOO, "a name chosen by the user stays"
    assert [weight_backend(name) for name in ("gloo", "nccl", "ipc")] == [GLOO, NCCL, IPC]
    with pytest.raises(ValueError, match="unknown weight-sync backend 'mpi': choose one of gloo, nccl, ipc, auto"):
        weight_backend("mpi")


def test_only_the_raiser_says_that_no_retry_can_fix_a_failure_and_its_text_keeps_saying_so():
    duplicate = RuntimeError("NCCL error: invalid usage, ncclInvalidUsage: Duplicate GPU detected: rank 1 and rank 0")
    assert not NcclCollectives().retry_helps(duplicate) and GlooCollectives().retry_helps(duplicate)
    assert NcclCollectives().retry_helps(RuntimeError("NCCL error: remote process exited"))
    hopeless, transient = WeightTransferError("two ranks on one GPU", retry_helps=False), WeightTransferError("late")
    assert (hopeless.retry_helps, transient.retry_helps) == (False, True)
    assert not retry_helps(Exception(f"Call to init_weight_transfer_engine method failed: {hopeless}"))
    assert retry_helps(transient) and str(transient) == "late"


def test_a_server_on_another_gpu_refuses_the_learners_buffer_as_no_retry_can_fix(monkeypatch):
    monkeypatch.setattr(ipc, "gpu_uuid", lambda device: "GPU-server")
    handle = IpcHandle("GPU-learner", "", 0, 0, "", 0, "", False)
    with pytest.raises(WeightTransferError, match=OTHER_GPU) as refused:
        SharedWeightsReader.open(handle.as_dict(), CPU)
    assert not refused.value.retry_helps


def test_where_each_backend_works_and_what_a_refusal_advises():
    assert [(backend.name, backend.kind.works(True), backend.kind.works(False)) for backend in BACKENDS.values()] == [
        ("gloo", True, True), ("nccl", False, True), ("ipc", True, False)]
    assert [backend.kind.device_type for backend in BACKENDS.values()] == ["cpu", "cuda", "cuda"]
    assert [backend.kind for backend in BACKENDS.values()] == list(KINDS.values())  # one implementation per kind
    assert alternatives(shared_gpu=True) == "gloo, ipc or auto"
    assert alternatives(shared_gpu=False) == "gloo, nccl or auto"
    assert alternatives(shared_gpu=None) == "gloo or auto"



def test_the_synchronous_reference_reaches_its_engine_by_nccl_apart_ipc_on_its_gpu_and_gloo_without_one(monkeypatch):
    assert group_backend(receiver_has_own_gpus=True) is NCCL
    cuda_seen(monkeypatch, 1)
    assert group_backend(receiver_has_own_gpus=False) is IPC  # loads in place, as the async job's colocated server
    cuda_seen(monkeypatch, 0)
    assert group_backend(receiver_has_own_gpus=False) is GLOO


def free_address(world_size: int = 2) -> GroupAddress:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return GroupAddress("127.0.0.1", port, world_size, "gloo", timeout_s=30.0)


def test_a_gloo_round_from_the_sending_end_to_a_receiving_end_built_from_its_init_request():
    sender = GLOO.sending_end(staging_bytes=1 << 20)
    address = sender.address("127.0.0.1", free_address().port, world_size=2, timeout_s=30.0)
    init_info = InitInfo(**sender.init_info(address, rank_offset=1))
    update_info = update_info_for(WEIGHTS)

    def receive() -> dict[str, torch.Tensor]:
        end = weight_backend(init_info.backend).receiving_end(init_info, init_info.rank_offset, CPU)
        received = dict(end.tensors(parse_update_info(update_info)))
        end.synchronize()
        end.close()
        return received

    with ThreadPoolExecutor(max_workers=1) as pool:
        receiving = pool.submit(receive)
        staged = sender.stage(WEIGHTS)
        sender.connect(address)
        seconds = sender.send(staged)
        received = receiving.result()
    sender.close()
    assert (init_info.backend, init_info.rank_offset, init_info.world_size) == ("gloo", 1, 2)
    assert not staged.moved and seconds > 0
    assert list(received) == [name for name, _ in WEIGHTS]
    assert all(torch.equal(received[name], tensor) for name, tensor in WEIGHTS)


def test_a_group_sends_nothing_before_it_is_connected():
    sender = GLOO.sending_end()
    with pytest.raises(RuntimeError, match="send before connect"):
        sender.send(sender.stage(WEIGHTS))


class CpuSharedWeights:
    """The CUDA IPC buffer's stand-in in CPU tests: the same layout, shared by reference; its "handle" names the buffer
    in `buffers`, where a server's stand-in finds it."""

    buffers: dict[str, torch.Tensor] = {}
    WRITE_S = 0.25  # what each write reports as the round's transfer time

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # [size_bytes] uint8
        self.handle: IpcHandle | None = None

    def reserve(self, named_tensors) -> bool:
        _, size = byte_layout([t.numel() * t.element_size() for _, t in named_tensors])
        if self.buffer is not None and self.buffer.numel() >= size:
            return False
        self.buffer = torch.empty(size, dtype=torch.uint8)
        key = f"buffer-{len(self.buffers)} of {size} bytes"
        self.buffers[key] = self.buffer
        self.handle = IpcHandle("cpu", key, size, 0, "", 0, "", False)
        return True

    def write(self, named_tensors) -> float:
        pack_into(self.buffer, named_tensors)
        return self.WRITE_S

    def close(self) -> None:
        self.buffer = None


def test_the_ipc_end_transfers_while_staging_and_moves_only_when_the_weights_outgrow_its_buffer():
    shared = CpuSharedWeights()
    sender = IpcSendingEnd(shared)
    first = sender.stage(WEIGHTS)
    assert first.moved and first.tensors == [] and sender.send(first) == CpuSharedWeights.WRITE_S
    assert not sender.stage(WEIGHTS).moved, "the same sizes: the servers keep their mapping"
    address = sender.address("127.0.0.1", 29500, world_size=3, timeout_s=5.0)
    assert (address.port, address.backend) == (0, "ipc"), "no store to meet at"
    init_info = sender.init_info(address, rank_offset=2)
    assert init_info["ipc"]["handle"].endswith(" of 536 bytes") and init_info["rank_offset"] == 2
    views = dict(SharedWeightsReader(shared.buffer).tensors(parse_update_info(update_info_for(WEIGHTS))))
    assert all(torch.equal(views[name], tensor) for name, tensor in WEIGHTS)
    assert sender.stage([*WEIGHTS, ("d.extra", torch.ones(1000))]).moved


def test_what_each_backend_is_loads_without_torch_for_the_launchers_placement():
    import subprocess
    import sys

    script = ("import sys; import asyncrl.placement, launch.commands.run, launch.commands.rollout; "
              "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"  # `asyncrl run` plans the job before any role (or torch) loads
