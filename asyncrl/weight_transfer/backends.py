"""The weight backends, and the one place a backend name becomes a backend.

- gloo: a private group over CPU memory; works wherever the roles are.
- nccl: the same group over GPUs; NCCL joins no two ranks on one GPU, so not where a server shares the learner's.
- ipc: no group, one CUDA IPC buffer on the learner's GPU that the servers there map.

`rollout.weight_sync.backend: auto` is decided per server: ipc where a plan puts the server on the learner's GPU, nccl
where it has GPUs of its own (`kinds.placed_kind`, which the launcher's placement reads without torch); without a plan,
nccl where CUDA is seen, else gloo (`weight_backend`). One job may use two: ipc for a server beside the learner, nccl
for servers on GPUs of their own.
"""

from __future__ import annotations

import torch

from asyncrl.weight_transfer.collectives import GlooCollectives, NcclCollectives
from asyncrl.weight_transfer.group_backend import GroupBackend
from asyncrl.weight_transfer.interface import WeightBackend
from asyncrl.weight_transfer.ipc_backend import IpcBackend
from asyncrl.weight_transfer.kinds import AUTO, GLOO_KIND, NCCL_KIND, placed_kind

GLOO = GroupBackend(GLOO_KIND, GlooCollectives())
NCCL = GroupBackend(NCCL_KIND, NcclCollectives())
IPC = IpcBackend()
BACKENDS: dict[str, WeightBackend] = {backend.name: backend for backend in (GLOO, NCCL, IPC)}


def weight_backend(name: str, shared_gpu: bool | None = None) -> WeightBackend:
    """The backend `name` names; for `auto`, the one of a plan's place (`shared_gpu`: ipc on the learner's GPU, nccl
    on GPUs of their own, `kinds.placed_kind`) or, with no plan to say (`None`), nccl where this process sees CUDA,
    else gloo. A ValueError names the choices."""
    if name == AUTO and shared_gpu is None:
        return NCCL if sees_cuda() else GLOO
    return BACKENDS[placed_kind(name, bool(shared_gpu)).name]


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
