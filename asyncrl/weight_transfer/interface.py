"""The one interface of the ways weights travel from the learner to the rollout servers (`backends.py` names them).

A backend is used from both ends of a round:
- the learner's `SendingEnd` stages the round's weights before any server is invited, tells each server of a new
  membership how to reach them (its init request), connects once the servers were invited, sends, and drops the
  connection after a failed round;
- a server's vLLM plugin gets a `ReceivingEnd` from that init request (`WeightBackend.receiving_end`) and pulls
  each announced tensor from it, in the update's order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import torch

from asyncrl.weight_transfer.group import GroupAddress, default_device
from asyncrl.weight_transfer.kinds import BackendKind
from asyncrl.weight_transfer.protocol import InitInfo, NamedTensors, TensorMeta


@dataclass
class Staged:
    """A round's weights, made ready before the servers are invited (and pause)."""

    tensors: NamedTensors  # what `SendingEnd.send` still has to send
    seconds: float = 0.0  # transfer time already spent while staging (ipc: the copy into the shared buffer)
    moved: bool = False  # the weights are somewhere new: every server must be sent a new init request


class SendingEnd(ABC):
    """The learner's end of a backend, kept across rounds."""

    @abstractmethod
    def stage(self, named_tensors: NamedTensors) -> Staged:
        """Get the round's weights ready to send, while the servers still sample."""

    @abstractmethod
    def address(self, host: str, port: int, world_size: int, timeout_s: float) -> GroupAddress:
        """Where a new membership of `world_size` ranks meets (`port` 0: a free one, where the backend needs one)."""

    @abstractmethod
    def init_info(self, address: GroupAddress, rank_offset: int) -> dict[str, Any]:
        """The init request of the server whose first worker takes rank `rank_offset` at `address`."""

    @abstractmethod
    def connect(self, address: GroupAddress) -> None:
        """Meet the invited servers at `address` (after their init requests went out); WeightTransferError when
        they are not all there by the deadline."""

    @abstractmethod
    def send(self, staged: Staged) -> float:
        """Transfer the staged weights to every connected server; the seconds the transfer took."""

    def disconnect(self) -> None:
        """Drop the connection to the servers (after a failed round, or when the membership changes)."""

    def close(self) -> None:
        """Release everything, the connection included."""
        self.disconnect()


class ReceivingEnd(Protocol):
    """A server worker's end of a backend: the announced tensors, in order."""

    device: torch.device  # where the received tensors are

    def tensors(self, metas: Sequence[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of each announced tensor, received as the caller asks for the next one."""

    def whole_round(self, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]] | None:
        """(name, tensor) of every announced tensor at once, where holding them all costs nothing (views of a round
        already on the device), for a batched load; None where each is received as the caller asks (`tensors`)."""

    def synchronize(self) -> None:
        """Wait until the round's receives (and the loads queued behind them) are done."""

    def close(self) -> None: ...


class WeightBackend(ABC):
    """One way of carrying weights: what it is (`kind`: its name, where it works), and its two ends."""

    kind: BackendKind  # its name and where it works, which the launcher's placement reads without torch

    @property
    def name(self) -> str:
        """As rollout.weight_sync.backend and the init request spell it."""
        return self.kind.name

    def device(self) -> torch.device:
        """Where this process's end sends from or receives into, unless told otherwise."""
        return default_device(self.kind.device_type)

    @abstractmethod
    def sending_end(self, staging_bytes: int = 0) -> SendingEnd:
        """The learner's end; `staging_bytes`: device memory for staging a round's weights before the servers
        are invited, where the backend stages by copying (0: each tensor is copied as it is sent)."""

    @abstractmethod
    def receiving_end(self, init_info: InitInfo, rank: int, device: torch.device,
                      previous: ReceivingEnd | None = None) -> ReceivingEnd:
        """A server worker's end, as group rank `rank` on `device`, from its init request; `previous` (the end it
        holds) is returned when it still reaches the same weights."""
