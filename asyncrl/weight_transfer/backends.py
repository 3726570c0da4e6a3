"""The weight backends, and the one place a backend name becomes a backend.

- gloo: a private group over CPU memory; works wherever the roles are.
- nccl: the same group over GPUs; NCCL joins no two ranks on one GPU, so not where a server shares the learner's.
- ipc: no group, one CUDA IPC buffer on the learner's GPU that the servers there map.

`rollout.weight_sync.backend: auto` is decided per server, by `weight_backend` alone: ipc where a plan puts the server
on the learner's GPU, nccl where it has GPUs of its own; without a plan, nccl where CUDA is seen, else gloo. One job
may use two: ipc for a server beside the learner, nccl for servers on GPUs of their own.
"""

from __future__ import annotations

from typing import Collection

import torch

from asyncrl.weight_transfer.collectives import GlooCollectives, NcclCollectives
from asyncrl.weight_transfer.group_backend import GroupBackend
from asyncrl.weight_transfer.interface import WeightBackend
from asyncrl.weight_transfer.ipc_backend import IpcBackend

AUTO = "auto"
GLOO = GroupBackend("gloo", "gloo", GlooCollectives(), on_a_shared_gpu=True)
NCCL = GroupBackend("nccl", "NCCL", NcclCollectives(), on_a_shared_gpu=False,
                    limit="NCCL cannot join two ranks on one GPU")
IPC = IpcBackend()
BACKENDS: dict[str, WeightBackend] = {backend.name: backend for backend in (GLOO, NCCL, IPC)}


def weight_backend(name: str, shared_gpu: bool | None = None) -> WeightBackend:
    """The backend `name` names, and the only place `auto` becomes one: ipc for a server a plan puts on the learner's
    GPU (`shared_gpu`), nccl for one it gives GPUs of their own; with no plan to say (`None`), nccl where this process
    sees CUDA, else gloo. A ValueError names the choices."""
    backend = named(name)
    if backend is not None:
        return backend
    if shared_gpu is None:
        return NCCL if sees_cuda() else GLOO
    return IPC if shared_gpu else NCCL


def named(name: str) -> WeightBackend | None:
    """The backend `name` names; None for `auto`, which `weight_backend` decides."""
    if name == AUTO:
        return None
    try:
        return BACKENDS[name]
    except KeyError:
        choices = ", ".join([*BACKENDS, AUTO])
        raise ValueError(f"unknown weight-sync backend '{name}': choose one of {choices}") from None


def group_backend(receiver_has_own_gpus: bool) -> WeightBackend:
    """How a trainer reaches an engine of its own (the synchronous reference): NCCL where the engine has GPUs of its
    own, CUDA IPC where it shares this process's GPU (NCCL joins no two ranks on one GPU; IPC loads as fast as the
    async job's colocated server does), gloo without a GPU."""
    if receiver_has_own_gpus:
        return NCCL
    return IPC if sees_cuda() else GLOO


def sees_cuda() -> bool:
    """Whether this process sees a GPU, asked of NVML where it answers: `torch.cuda.is_available()` initializes
    CUDA's driver, after which a forked child cannot use CUDA, and the synchronous reference asks before vLLM forks
    its engine core from it."""
    return torch.cuda.device_count() > 0


def alternatives(shared_gpu: bool | None, elsewhere: Collection[bool] = ()) -> str:
    """What a refused backend's error advises: the names that work where a server does (`shared_gpu`) or does not
    share the learner's GPU, and where each other server of the plan is (`elsewhere`, the same for each);
    `None`: on a machine without a GPU."""
    if shared_gpu is None:
        fitting = [backend.name for backend in BACKENDS.values() if backend.device_type == "cpu"]
    else:
        places = {shared_gpu, *elsewhere}
        fitting = [backend.name for backend in BACKENDS.values() if all(backend.works(place) for place in places)]
    return ", ".join(fitting) + f" or {AUTO}"
