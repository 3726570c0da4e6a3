"""Trainer side of the weight transfer: host the group as rank 0 and broadcast each round's tensors."""

from __future__ import annotations

import logging
import time

import torch

from asyncrl.weight_transfer.group import TRAINER_RANK, GroupAddress, TransferGroup
from asyncrl.weight_transfer.protocol import NamedTensors

log = logging.getLogger(__name__)


class WeightSender:
    """Owns the trainer's end of the group. `open` blocks until every worker has joined (or the deadline)."""

    def __init__(self, group: TransferGroup) -> None:
        self._group = group

    @classmethod
    def open(cls, address: GroupAddress, device: torch.device | None = None) -> WeightSender:
        return cls(TransferGroup.join(address, TRAINER_RANK, device))

    @property
    def address(self) -> GroupAddress:
        return self._group.address

    def send_weights(self, named_tensors: NamedTensors) -> float:
        """Broadcast every tensor, in order, to all workers; return the seconds it took.

        The workers must have been handed `update_info_for(named_tensors)` and be receiving concurrently.
        """
        started = time.perf_counter()
        total_bytes = 0
        for _, tensor in named_tensors:
            wire = _materialised(tensor).to(self._group.device)  # NCCL sends from the GPU only
            self._group.broadcast(wire)
            total_bytes += wire.numel() * wire.element_size()
        self._group.synchronize()
        seconds = time.perf_counter() - started
        log.info("sent %d tensors (%.1f MiB) in %.3fs", len(named_tensors), total_bytes / 2**20, seconds)
        return seconds

    def close(self) -> None:
        self._group.close()


def _materialised(tensor: torch.Tensor) -> torch.Tensor:
    """A full, contiguous tensor: FSDP shards (DTensor) gather via `full_tensor()`, views are copied."""
    full_tensor = getattr(tensor, "full_tensor", None)
    full = full_tensor() if callable(full_tensor) else tensor
    return full.contiguous()
