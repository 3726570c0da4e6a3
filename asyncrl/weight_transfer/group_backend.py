"""The gloo and NCCL backends: a private `TransferGroup` in which the learner (rank 0) broadcasts each tensor.

The learner's end opens the group once the servers were invited, and keeps it while the membership holds;
staging copies what fits in `staging_bytes` onto the sending device before the servers pause
(`stage_for_transfer`). A server's end joins the group at its init request and receives each announced tensor
into a fresh buffer.
"""

from __future__ import annotations

import socket
from typing import Any, Iterator, Sequence

import torch

from asyncrl.weight_transfer.collectives import Collectives
from asyncrl.weight_transfer.group import TRAINER_RANK, GroupAddress, TransferGroup, listen_on
from asyncrl.weight_transfer.interface import ReceivingEnd, SendingEnd, Staged, WeightBackend
from asyncrl.weight_transfer.kinds import BackendKind
from asyncrl.weight_transfer.protocol import InitInfo, NamedTensors, TensorMeta, init_info_for
from asyncrl.weight_transfer.sender import send_weights, stage_for_transfer


class GroupBackend(WeightBackend):
    def __init__(self, kind: BackendKind, collectives: Collectives) -> None:
        self.kind, self.collectives = kind, collectives  # gloo's or NCCL's: their device is the kind's

    def join(self, address: GroupAddress, rank: int, device: torch.device | None = None,
             listener: socket.socket | None = None) -> TransferGroup:
        """Join the group at `address` as `rank` (the trainer is rank 0, its store on `listener` if given)."""
        return TransferGroup.join(address, rank, self.collectives, device, listener)

    def sending_end(self, staging_bytes: int = 0) -> SendingEnd:
        return GroupSendingEnd(self, staging_bytes)

    def receiving_end(self, init_info: InitInfo, rank: int, device: torch.device,
                      previous: ReceivingEnd | None = None) -> ReceivingEnd:
        return GroupReceivingEnd(self.join(init_info.address(), rank, device))


class GroupSendingEnd(SendingEnd):
    def __init__(self, backend: GroupBackend, staging_bytes: int) -> None:
        self.backend, self.staging_bytes = backend, staging_bytes
        self._group: TransferGroup | None = None  # its rank 0 (the trainer's), once connected
        # The port of the address planned last, held from the moment it is chosen until the store takes it over in
        # `connect`: a port found free and bound later could be taken in between by another process on the host.
        self._listener: socket.socket | None = None

    def stage(self, named_tensors: NamedTensors) -> Staged:
        return Staged(stage_for_transfer(named_tensors, self.backend.device(), self.staging_bytes))

    def address(self, host: str, port: int, world_size: int, timeout_s: float) -> GroupAddress:
        self._release_listener()
        self._listener = listen_on(host, port)
        return GroupAddress(host, self._listener.getsockname()[1], world_size, self.backend.name, timeout_s)

    def init_info(self, address: GroupAddress, rank_offset: int) -> dict[str, Any]:
        return init_info_for(address, rank_offset)

    def connect(self, address: GroupAddress) -> None:
        self.disconnect()
        listener, self._listener = self._listener, None
        if listener is not None and listener.getsockname()[1] != address.port:  # not the address planned last
            listener.close()
            listener = None
        self._group = self.backend.join(address, TRAINER_RANK, listener=listener)

    def send(self, staged: Staged) -> float:
        if self._group is None:
            raise RuntimeError("send before connect: no group to broadcast in")
        return staged.seconds + send_weights(self._group, staged.tensors)

    def disconnect(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None

    def close(self) -> None:
        self._release_listener()
        super().close()

    def _release_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
        self._listener = None


class GroupReceivingEnd:
    """A worker's member of the group: each announced tensor broadcast into a buffer of its own."""

    def __init__(self, group: TransferGroup) -> None:
        self.group = group
        self.device = group.device

    def tensors(self, metas: Sequence[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        for meta in metas:
            buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            self.group.broadcast(buffer)
            yield meta.name, buffer

    def whole_round(self, metas: Sequence[TensorMeta]) -> None:
        """None: each tensor is broadcast into a buffer of its own as the loader asks for it, and freed once loaded.
        Holding a whole round would put a second copy of the weights in the server's device memory (15 GB for the 7B
        shape), beyond what vLLM planned its KV cache around; the batched load is for the shared buffer (ipc), whose
        views cost nothing."""
        return None

    def synchronize(self) -> None:
        self.group.synchronize()

    def close(self) -> None:
        self.group.close()
