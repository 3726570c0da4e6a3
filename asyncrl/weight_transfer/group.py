"""A private torch.distributed group for weight transfer: trainer at rank 0, rollout workers at 1..N.

Built from a `TCPStore` and a bare process-group backend object instead of `init_process_group`, so it
lives beside the learner's own FSDP world (and vLLM's internal groups) without touching the global
default group. Every step has a deadline: the store rendezvous, the backend's connection handshake
and each broadcast raise `WeightTransferError` when it passes, so neither side hangs on the other.
What differs between gloo and NCCL (how a broadcast is waited for, how a round is bounded, how pending
work is aborted) is the group's `Collectives` (`collectives.py`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.weight_transfer.collectives import Collectives

log = logging.getLogger(__name__)

TRAINER_RANK = 0  # the sender; rollout workers take ranks 1..world_size-1
_STORE_PREFIX = "asyncrl/weight_transfer"  # namespaces our keys should the store ever be shared
_HANDSHAKE_VALUE = 20261122  # broadcast once at join: proves the data path works end to end
_POLL_S = 0.2  # how often a member re-checks, while waiting, for the trainer's port or the other members
_JOINED_KEY = "joined"  # store counter: members that have arrived
# how the text of a WeightTransferError says that no retry can fix it: a server's error reaches its sync client as text
# alone (vLLM's engine core re-raises a worker's error as a plain Exception of its message)
NO_RETRY = "(no retry can fix this)"


class WeightTransferError(RuntimeError):
    """A rendezvous or transfer of the weight-transfer group failed or passed its deadline. `retry_helps` is False
    where the raiser knows that no later round can succeed as the roles are placed (NCCL ranks on one GPU, a CUDA IPC
    buffer on another GPU): the coordinator then gives up on the servers at once instead of after `max_failures`."""

    def __init__(self, message: str, retry_helps: bool = True) -> None:
        super().__init__(message if retry_helps else f"{message} {NO_RETRY}")
        self.retry_helps = retry_helps


def retry_helps(error: BaseException) -> bool:
    """Whether a retry may fix `error`: False for a WeightTransferError raised so, also once only its text is left."""
    return NO_RETRY not in str(error)


@dataclass(frozen=True)
class GroupAddress:
    """Where and how the group meets; identical on every member."""

    host: str  # address of the trainer's TCPStore (rank 0 listens, the others connect)
    port: int  # TCP port of that store
    world_size: int  # trainer plus every receiving worker
    backend: str  # name of the weight backend (`backends.py`): "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    timeout_s: float  # deadline for the rendezvous and for each broadcast, in seconds

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def describe(self) -> str:
        return f"{self.backend} group at {self.host}:{self.port} (world size {self.world_size})"


class TransferGroup:
    """One member's handle on the group: broadcast from the trainer, bounded by the deadline."""

    def __init__(self, address: GroupAddress, rank: int, store: dist.Store, process_group: dist.Backend,
                 device: torch.device, collectives: Collectives) -> None:
        self.address = address
        self.rank = rank
        self._store = store  # rank 0 hosts the store server: it must outlive the group
        self._process_group = process_group
        self.device = device  # where this member sends and receives
        self._collectives = collectives

    @classmethod
    def join(cls, address: GroupAddress, rank: int, collectives: Collectives,
             device: torch.device | None = None, listener: socket.socket | None = None) -> TransferGroup:
        """Meet the other members over `collectives`; raise `WeightTransferError` if they are not all there in
        time. Without a `device`, a member of a CUDA backend uses the current CUDA device, else the CPU. The
        trainer's store takes over `listener` (`listen_on`, bound when the address was chosen), else binds now."""
        started = time.perf_counter()
        store = _open_store(address, rank, listener)
        process_group = _connect(address, rank, store, collectives)
        device = device or default_device(collectives.device_type)
        group = cls(address, rank, store, process_group, device, collectives)
        group._bounded_handshake(group.device)
        log.info("joined %s as rank %d in %.2fs", address.describe(), rank, time.perf_counter() - started)
        return group

    def broadcast(self, tensor: torch.Tensor, src: int = TRAINER_RANK) -> None:
        """Send `tensor` from `src` to every member (in place on receivers).

        gloo: returns once done, bounded by the deadline. NCCL: enqueued on the current CUDA stream (work
        that reads `tensor` afterwards on that stream sees the received data); call `synchronize` to bound it.
        """
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.timeout = self.address.timeout
        try:
            self._collectives.await_broadcast(self._process_group.broadcast([tensor], options), self.address.timeout)
        except RuntimeError as error:
            raise WeightTransferError(
                f"broadcast of a {tuple(tensor.shape)} {tensor.dtype} tensor in {self.address.describe()} "
                f"failed or passed its {self.address.timeout_s}s deadline (rank {self.rank}): {error}",
                retry_helps=self._collectives.retry_helps(error),
            ) from error

    def synchronize(self) -> None:
        """Wait until every broadcast enqueued so far has completed, or raise once the deadline passes.

        A no-op for gloo (its broadcasts complete before returning). For NCCL a passed deadline aborts the
        communicator, so no kernel stays blocked on a missing peer; the group is unusable afterwards.
        """
        if not self._collectives.wait_for_enqueued(self.address.timeout_s):
            self.abort()
            raise WeightTransferError(
                f"broadcasts in {self.address.describe()} did not complete within the "
                f"{self.address.timeout_s}s deadline (rank {self.rank}); the communicator was aborted"
            )

    def abort(self) -> None:
        """Abort the backend's pending work (NCCL: ncclCommAbort) and drop the group."""
        process_group = self._process_group
        self.close()
        if process_group is not None:
            self._collectives.abort(process_group)

    def close(self) -> None:
        """Drop the backend and the store (rank 0's store server stops with it)."""
        self._process_group = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]

    def _bounded_handshake(self, device: torch.device) -> None:
        """Run the handshake on a helper thread and stop waiting for it at the deadline.

        NCCL creates its communicator inside the first collective, a call that blocks until every peer is
        there; bounding it from the outside is the only way to keep that under the deadline.
        """
        outcome: list[BaseException | None] = []

        def handshake() -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)  # the CUDA device is per thread
                self._handshake(device)
                outcome.append(None)
            except BaseException as error:  # handed to the waiting thread below
                outcome.append(error)

        thread = threading.Thread(target=handshake, name="weight-transfer-handshake", daemon=True)
        thread.start()
        thread.join(self.address.timeout_s)
        if not outcome:
            self.abort()
            raise WeightTransferError(
                f"rank {self.rank} could not connect the {self.address.describe()} within its "
                f"{self.address.timeout_s}s deadline (the backend's handshake did not return)"
            )
        if outcome[0] is not None:
            self.close()
            raise outcome[0]

    def _handshake(self, device: torch.device) -> None:
        """One tiny broadcast proves the data path end to end (and makes NCCL create its communicator)."""
        probe = torch.tensor([_HANDSHAKE_VALUE if self.rank == TRAINER_RANK else 0], device=device)
        self.broadcast(probe)
        self.synchronize()
        if int(probe.item()) != _HANDSHAKE_VALUE:
            raise WeightTransferError(f"handshake in {self.address.describe()} returned {int(probe.item())}")


def _open_store(address: GroupAddress, rank: int, listener: socket.socket | None) -> dist.Store:
    """Rank 0 listens (on `listener` if given); the others connect. Returns once all members are in, within one
    deadline."""
    is_trainer = rank == TRAINER_RANK
    deadline = time.monotonic() + address.timeout_s
    try:
        if not is_trainer:
            _wait_for_listener(address, deadline)
        store = dist.TCPStore(
            address.host,
            address.port,
            world_size=address.world_size,
            is_master=is_trainer,
            timeout=address.timeout,
            wait_for_workers=False,  # torch's own wait overshoots by a second; _await_members keeps the deadline
            master_listen_fd=(listener or listen_on(address.host, address.port)).detach() if is_trainer else None,
        )
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        _await_members(prefixed, address, deadline)
    except (RuntimeError, OSError) as error:  # torch's DistStoreError/DistNetworkError; TimeoutError is an OSError
        waiting_for = "all rollout workers to connect" if is_trainer else "the trainer's store"
        raise WeightTransferError(
            f"rendezvous of rank {rank} in {address.describe()}: gave up after {address.timeout_s}s "
            f"waiting for {waiting_for}: {error}"
        ) from error
    return prefixed


def listen_on(host: str, port: int) -> socket.socket:
    """A socket listening on `host` alone (`port` 0: one the OS picks as it binds), for the trainer's store to take
    over: torch's store server listens on every interface, so a group meeting on 127.0.0.1 was reachable from the
    network. Listening, the port is held: no other process can bind it until the store closes it."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def _wait_for_listener(address: GroupAddress, deadline: float) -> None:
    """Poll the trainer's port until it accepts or the deadline passes.

    TCPStore's own client retries with back-off and overshoots its timeout by seconds; polling first keeps
    a missing trainer's error inside the deadline.
    """
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"nothing listened on {address.host}:{address.port}")
        try:
            with socket.create_connection((address.host, address.port), timeout=min(remaining, _POLL_S)):
                return
        except OSError:
            time.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0)))


def _await_members(store: dist.Store, address: GroupAddress, deadline: float) -> None:
    """Count this member in, then wait until all have arrived or the deadline passes."""
    joined = store.add(_JOINED_KEY, 1)
    while joined < address.world_size:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{joined}/{address.world_size} members joined")
        time.sleep(_POLL_S)
        joined = store.add(_JOINED_KEY, 0)


def _connect(address: GroupAddress, rank: int, store: dist.Store, collectives: Collectives) -> dist.Backend:
    try:
        return collectives.connect(store, rank, address.world_size, address.timeout)
    except RuntimeError as error:
        raise WeightTransferError(f"rank {rank} could not connect the {address.describe()}: {error}",
                                  retry_helps=collectives.retry_helps(error)) from error


def default_device(device_type: str) -> torch.device:
    """This process's device of `device_type`: the current CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
