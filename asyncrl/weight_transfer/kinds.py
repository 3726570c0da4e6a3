"""What each weight backend is, without torch: its name, where it works and why not elsewhere.

The placement reads these and `asyncrl.gpu_ids` (which counts the GPUs through NVIDIA's management library), so that
`asyncrl run` plans a job without importing torch (about 1 s of a 2-core machine's launch, before any role starts;
seconds more on a GPU host). `backends` pairs each kind with its implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

AUTO = "auto"  # rollout.weight_sync.backend's default: decided per server, where the plan puts it


@dataclass(frozen=True)
class BackendKind:
    name: str  # as rollout.weight_sync.backend and the init request spell it
    title: str  # as error messages name it
    device_type: str  # where both ends hold what they send and receive: "cuda" or "cpu"
    on_a_shared_gpu: bool  # works where a rollout server shares the learner's GPU
    on_gpus_apart: bool  # works where every rollout server has GPUs of its own
    limit: str = ""  # why it does not work where it does not (what a refusal says)

    def works(self, shared_gpu: bool) -> bool:
        """It works where a server does (`shared_gpu`) or does not share the learner's GPU."""
        return self.on_a_shared_gpu if shared_gpu else self.on_gpus_apart


GLOO_KIND = BackendKind("gloo", "gloo", "cpu", on_a_shared_gpu=True, on_gpus_apart=True)
NCCL_KIND = BackendKind("nccl", "NCCL", "cuda", on_a_shared_gpu=False, on_gpus_apart=True,
                        limit="NCCL cannot join two ranks on one GPU")
IPC_KIND = BackendKind("ipc", "CUDA IPC", "cuda", on_a_shared_gpu=True, on_gpus_apart=False,
                       limit="CUDA IPC needs every server on the learner's GPU")
KINDS: dict[str, BackendKind] = {kind.name: kind for kind in (GLOO_KIND, NCCL_KIND, IPC_KIND)}


def named_kind(name: str) -> BackendKind | None:
    """The backend `name` names; None for `auto`, which the plan decides. A ValueError names the choices."""
    if name == AUTO:
        return None
    try:
        return KINDS[name]
    except KeyError:
        choices = ", ".join([*KINDS, AUTO])
        raise ValueError(f"unknown weight-sync backend '{name}': choose one of {choices}") from None


def placed_kind(name: str, shared_gpu: bool) -> BackendKind:
    """The backend of a server a plan puts on the learner's GPU (`shared_gpu`) or on GPUs of its own: the one `name`
    names, or for `auto` ipc beside the learner and nccl apart."""
    return named_kind(name) or (IPC_KIND if shared_gpu else NCCL_KIND)


def alternatives(shared_gpu: bool | None, elsewhere: Collection[bool] = ()) -> str:
    """What a refused backend's error advises: the names that work where a server does (`shared_gpu`) or does not
    share the learner's GPU, and where each other server of the plan is (`elsewhere`, the same for each);
    `None`: on a machine without a GPU."""
    if shared_gpu is None:
        fitting = [kind.name for kind in KINDS.values() if kind.device_type == "cpu"]
    else:
        places = {shared_gpu, *elsewhere}
        fitting = [kind.name for kind in KINDS.values() if all(kind.works(place) for place in places)]
    return ", ".join(fitting) + f" or {AUTO}"
