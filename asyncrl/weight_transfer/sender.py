"""Trainer side of a group transfer: stage a round's tensors on the sending device, then broadcast each from rank 0."""

from __future__ import annotations

import logging
import time

import torch

from asyncrl.weight_transfer.group import TransferGroup
from asyncrl.weight_transfer.protocol import NamedTensors

log = logging.getLogger(__name__)


def send_weights(group: TransferGroup, named_tensors: NamedTensors) -> float:
    """Broadcast every tensor, in order, from the trainer's rank of `group` to all workers; return the seconds
    it took. The workers must have been handed `update_info_for(named_tensors)` and be receiving concurrently."""
    started = time.perf_counter()
    total_bytes = 0
    for _, tensor in named_tensors:
        wire = materialised(tensor).to(group.device)  # NCCL sends from the GPU only
        group.broadcast(wire)
        total_bytes += wire.numel() * wire.element_size()
    group.synchronize()
    seconds = time.perf_counter() - started
    log.info("sent %d tensors (%.1f MiB) in %.3fs", len(named_tensors), total_bytes / 2**20, seconds)
    return seconds


def stage_for_transfer(named_tensors: NamedTensors, device: torch.device, budget_bytes: int) -> NamedTensors:
    """The tensors to send, as many as `budget_bytes` holds already full, contiguous and on `device`.

    Staging before the servers are invited moves the host-to-GPU copies of weights kept in CPU memory out
    of the servers' pause, which then covers the broadcast alone. Tensors past the budget stay where they
    are and are copied one at a time as they are sent. Without the memory for them, nothing is staged."""
    staged: NamedTensors = []
    used = 0
    try:
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if used + nbytes <= budget_bytes:
                tensor = materialised(tensor).to(device)
                used += nbytes
            staged.append((name, tensor))
    except torch.OutOfMemoryError:
        log.warning("no %s memory to stage %.1f MiB of weights: sending them unstaged (the servers pause longer); "
                    "lower rollout.weight_sync.staging_bytes (now %d) to stage less", device, used / 2**20, budget_bytes)
        return list(named_tensors)
    return staged


def materialised(tensor: torch.Tensor) -> torch.Tensor:
    """A full, contiguous tensor: FSDP shards (DTensor) gather via `full_tensor()`, views are copied. A shard
    kept in CPU memory (FSDP's CPU offload) is gathered on its mesh's device, where the collectives run."""
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is not None and tensor.device.type != mesh.device_type:
        tensor = tensor.to(mesh.device_type)
    full_tensor = getattr(tensor, "full_tensor", None)
    full = full_tensor() if callable(full_tensor) else tensor
    return full.contiguous()
