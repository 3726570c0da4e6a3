"""The learner's own process group (gloo on CPU, NCCL on GPU) and helpers over it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.net import LOOPBACK


@dataclass(frozen=True)
class World:
    rank: int  # this process's rank among the learner ranks
    size: int  # number of learner ranks
    device: torch.device  # where this rank computes

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def spawner_store(size: int) -> dist.TCPStore:
    """The rendezvous store of `size` local ranks, held by the process that spawns them (as torchrun's agent holds
    it), on a port the OS assigns as it binds. A port found free first and bound later by rank 0 can be taken in
    between by another job on the host: one run in about a hundred, twenty at a time on one host, died of it."""
    return dist.TCPStore(LOOPBACK, 0, world_size=size, is_master=True, wait_for_workers=False)


def local_rank_environment(rank: int, size: int, store_port: int) -> dict[str, str]:
    """The torchrun-style variables of local rank `rank` of `size`, whose spawner holds their store on
    `store_port` (`spawner_store`): with TORCHELASTIC_USE_AGENT_STORE every rank connects to it, rank 0 too."""
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(store_port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


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
        backend = ("cuda:nccl,cpu:gloo" if cpu_collectives else "nccl") if use_cuda else "gloo"
        # one rank meets no one: an in-process store, no port to collide with another job's; more ranks meet at
        # MASTER_ADDR:MASTER_PORT (their spawner's store, torchrun's, or the Ray launcher's)
        store = dist.HashStore() if size == 1 else None
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                device_id=device if use_cuda else None)
    return World(rank=rank, size=size, device=device)


def init_single_rank_world(device_choice: str) -> World:
    """A world of one rank (its store in this process: no port), on `device_choice` as `init_world` reads it:
    FSDP2 needs a process group even alone (the synchronous reference, the learner benchmarks)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    return init_world(device_choice)


def broadcast_bytes(payload: bytes | None, world: World) -> bytes:
    """Rank 0's bytes on every rank (a msgpack frame; no pickle between ranks either)."""
    length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.long, device=world.device)
    dist.broadcast(length, src=0)
    buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=world.device)
    if world.is_main:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return buffer.cpu().numpy().tobytes()


def gather_varying(values: torch.Tensor, world: World) -> list[torch.Tensor]:
    """Every rank's 1-D `values` (lengths may differ, dtype the same), in rank order."""
    if world.size == 1:
        return [values]
    length = torch.tensor([values.numel()], dtype=torch.long, device=world.device)
    lengths = [torch.zeros_like(length) for _ in range(world.size)]
    dist.all_gather(lengths, length)
    counts = [int(count) for count in lengths]
    padded = torch.zeros(max(counts), dtype=values.dtype, device=world.device)  # all_gather needs equal shapes
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(world.size)]
    dist.all_gather(gathered, padded)
    return [rank_values[:count] for rank_values, count in zip(gathered, counts)]


def all_gather_bytes(payload: bytes, world: World) -> list[bytes]:
    """Every rank's `payload` on every rank, in rank order (msgpack frames: no pickle between ranks)."""
    if world.size == 1:  # nothing to gather: no copy through a tensor (and the GPU) at every step of a one-rank run
        return [payload]
    # [n] uint8; frombuffer refuses an empty buffer
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
    return [part.cpu().numpy().tobytes() for part in gather_varying(mine.to(world.device), world)]


def sum_across_ranks(values: dict[str, float], world: World) -> dict[str, float]:
    """Sum a dict of floats over the ranks (every rank must pass the same keys)."""
    if world.size == 1 or not values:
        return dict(values)
    keys = sorted(values)
    packed = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=world.device)
    dist.all_reduce(packed)
    return dict(zip(keys, packed.tolist()))
