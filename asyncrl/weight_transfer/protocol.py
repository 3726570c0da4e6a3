"""What travels beside the tensors: the init and update requests, as plain dicts for vLLM's control plane.

The tensors go over the transfer group; their names, dtypes and shapes go in the update request, so
a receiver can allocate each buffer before the matching broadcast arrives. Both sides iterate the
same list in the same order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from asyncrl.weight_transfer.group import GroupAddress

BACKEND_NAME = "asyncrl"  # name of our engine in vLLM's WeightTransferEngineFactory
TIED_HEAD_NAME = "lm_head.weight"  # output head that transformers omits from named_parameters() when tied

NamedTensors = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorMeta:
    name: str  # checkpoint (Hugging Face) parameter name, as vLLM's load_weights expects
    dtype: torch.dtype  # wire dtype
    shape: tuple[int, ...]  # full (unsharded) shape


@dataclass
class InitInfo:
    """Worker side of the init request: the group address and this server's first rank."""

    host: str  # the trainer's store address
    port: int  # the trainer's store port
    world_size: int  # trainer plus every receiving worker
    backend: str  # name of the weight backend that carries the weights (`backends.py`)
    timeout_s: float  # deadline of the rendezvous and of each broadcast, seconds
    rank_offset: int  # group rank of this server's first worker (its tensor-parallel rank 0)
    load_in_place: bool = False  # load into the serving parameters, no layerwise reload (the engine decides)
    ipc: dict[str, Any] = field(default_factory=dict)  # backend "ipc": the learner's shared buffer (`IpcHandle` fields)

    def address(self) -> GroupAddress:
        return GroupAddress(self.host, self.port, self.world_size, self.backend, self.timeout_s)


@dataclass
class UpdateInfo:
    """Worker side of one update request: the tensors about to be broadcast, in order."""

    names: list[str]
    dtype_names: list[str]  # torch dtype names without the "torch." prefix
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update info lists differ in length: {len(self.names)} names, "
                f"{len(self.dtype_names)} dtypes, {len(self.shapes)} shapes"
            )

    def tensors(self) -> list[TensorMeta]:
        return [
            TensorMeta(name, _dtype(dtype_name), tuple(shape))
            for name, dtype_name, shape in zip(self.names, self.dtype_names, self.shapes)
        ]


def init_info_for(address: GroupAddress, rank_offset: int, ipc: dict[str, Any] | None = None) -> dict[str, Any]:
    """The init request for the server whose first worker takes group rank `rank_offset` (with `ipc`, the
    shared buffer's handle, for backend "ipc")."""
    return dataclasses.asdict(
        InitInfo(address.host, address.port, address.world_size, address.backend, address.timeout_s, rank_offset,
                 ipc=dict(ipc or {}))
    )


def update_info_for(named_tensors: NamedTensors) -> dict[str, Any]:
    """The update request announcing `named_tensors` (metadata only; nothing is materialised)."""
    return dataclasses.asdict(
        UpdateInfo(
            names=[name for name, _ in named_tensors],
            dtype_names=[str(tensor.dtype).removeprefix("torch.") for _, tensor in named_tensors],
            shapes=[list(tensor.shape) for _, tensor in named_tensors],
        )
    )


def parse_update_info(update_info: dict[str, Any]) -> list[TensorMeta]:
    return UpdateInfo(**update_info).tensors()


def weights_for_transfer(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A Hugging Face model's parameters by checkpoint name, with the output head of a tied model.

    transformers yields a tied `lm_head.weight` nowhere in `named_parameters()`; vLLM's layerwise reload
    then keeps its old output head, so the head is sent explicitly under its own name.
    """
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    if _ties_output_head(model) and TIED_HEAD_NAME not in dict(named):
        named.append((TIED_HEAD_NAME, model.get_output_embeddings().weight.detach()))
    return named


def _ties_output_head(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False)) and model.get_output_embeddings() is not None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"update info names an unknown dtype '{name}'")
    return dtype
