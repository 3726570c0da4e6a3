"""The ipc backend: no group, one CUDA IPC buffer on the learner's GPU that colocated servers map (`ipc.py`).

Staging is the transfer: the round's weights are copied into the shared buffer, and waited for, before any server
is invited, so nothing is left to send once they are. A buffer made anew (the weights outgrew it) has new handles,
so every server is sent a new init request to map it. A server keeps its mapping while the handle stays the same.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.weight_transfer.group import GroupAddress
from asyncrl.weight_transfer.interface import ReceivingEnd, SendingEnd, Staged, WeightBackend
from asyncrl.weight_transfer.ipc import SharedWeights, SharedWeightsReader
from asyncrl.weight_transfer.kinds import IPC_KIND
from asyncrl.weight_transfer.protocol import InitInfo, NamedTensors, init_info_for

NO_PORT = 0  # no store to meet at: the init request carries the buffer's handle instead


class IpcBackend(WeightBackend):
    kind = IPC_KIND

    def sending_end(self, staging_bytes: int = 0) -> SendingEnd:
        return IpcSendingEnd(SharedWeights())

    def receiving_end(self, init_info: InitInfo, rank: int, device: torch.device,
                      previous: ReceivingEnd | None = None) -> ReceivingEnd:
        mapped = previous if isinstance(previous, SharedWeightsReader) else None
        return SharedWeightsReader.open(init_info.ipc, device, mapped)


class IpcSendingEnd(SendingEnd):
    def __init__(self, shared: SharedWeights) -> None:
        """`shared`: the buffer the servers map (its CPU stand-in in unit tests)."""
        self.shared = shared

    def stage(self, named_tensors: NamedTensors) -> Staged:
        moved = self.shared.reserve(named_tensors)
        return Staged([], self.shared.write(named_tensors), moved)

    def address(self, host: str, port: int, world_size: int, timeout_s: float) -> GroupAddress:
        return GroupAddress(host, NO_PORT, world_size, IPC_KIND.name, timeout_s)

    def init_info(self, address: GroupAddress, rank_offset: int) -> dict[str, Any]:
        return init_info_for(address, rank_offset, self.shared.handle.as_dict())

    def connect(self, address: GroupAddress) -> None:
        pass  # each server maps the buffer from its init request

    def send(self, staged: Staged) -> float:
        return staged.seconds  # written while staging, before the servers were invited

    def close(self) -> None:
        self.shared.close()
