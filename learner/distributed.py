"""The learner's own process group (gloo on CPU, NCCL on GPU) and helpers over it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int  # this process's rank among the learner ranks
    size: int  # number of learner ranks
    device: torch.device  # where this rank computes

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(device_choice: str, cpu_collectives: bool = False) -> World:
    """Join the process group described by torchrun-style environment variables (or run alone).
    `cpu_collectives` adds gloo beside NCCL on a GPU, for collectives over tensors kept in CPU memory
    (FSDP's CPU offload: the gradient norm of offloaded gradients)."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    rank = int(os.environ.get("RANK", "0"))
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        backend = ("cuda:nccl,cpu:gloo" if cpu_collectives else "nccl") if use_cuda else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=size, device_id=device if use_cuda else None)
    return World(rank=rank, size=size, device=device)


def broadcast_bytes(payload: bytes | None, world: World) -> bytes:
    """Rank 0's bytes on every rank (a msgpack frame; no pickle between ranks either)."""
    length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.long, device=world.device)
    dist.broadcast(length, src=0)
    buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=world.device)
    if world.is_main:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return buffer.cpu().numpy().tobytes()


def sum_across_ranks(values: dict[str, float], world: World) -> dict[str, float]:
    """Sum a dict of floats over the ranks (every rank must pass the same keys)."""
    if world.size == 1 or not values:
        return dict(values)
    keys = sorted(values)
    packed = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=world.device)
    dist.all_reduce(packed)
    return dict(zip(keys, packed.tolist()))
