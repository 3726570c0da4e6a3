"""What differs between the two process-group backends a `TransferGroup` can run on: gloo and NCCL.

gloo works on CPU tensors and every broadcast blocks the caller until it completes, bounded by the deadline.

NCCL differs in two ways that matter for deadlines. Its communicator is created by the first collective, a
blocking call that waits for every peer (the group runs that handshake on a helper thread it stops waiting for at
the deadline). And its broadcasts are stream-ordered, not CPU-blocking: a broadcast only enqueues, and the group
waits for everything enqueued by polling a CUDA event against the deadline, aborting the communicator when it
passes. NCCL's own watchdog gets a much longer timeout so that it never kills the process first.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_EVENT_POLL_S = 1e-4  # how often an NCCL round's completion event is re-checked
_WATCHDOG_FACTOR = 10  # NCCL's watchdog timeout, in deadlines: ours fires first and aborts cleanly
# NCCL's words for a group it will never form, however often asked (e.g. two ranks on one GPU: "Duplicate GPU")
_INVALID_USAGE = ("Duplicate GPU", "invalid usage", "ncclInvalidUsage")


class Collectives(ABC):
    """The backend-specific steps of a `TransferGroup`."""

    device_type: str  # where the members' tensors live: "cuda" or "cpu"

    @abstractmethod
    def connect(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.Backend:
        """The backend object of this member, on the group's store."""

    @abstractmethod
    def await_broadcast(self, work: dist.Work, timeout: timedelta) -> None:
        """What the caller waits for after enqueuing a broadcast (raises RuntimeError on failure)."""

    @abstractmethod
    def wait_for_enqueued(self, timeout_s: float) -> bool:
        """Wait until every broadcast enqueued so far has completed; False when `timeout_s` passed first."""

    def abort(self, process_group: dist.Backend) -> None:
        """Abort the backend's pending work, so that nothing stays blocked on a missing peer."""

    def retry_helps(self, error: RuntimeError) -> bool:
        """Whether connecting or broadcasting again may succeed after it raised `error` (a deadline, a peer gone)."""
        return True


class GlooCollectives(Collectives):
    device_type = "cpu"

    def connect(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.Backend:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def await_broadcast(self, work: dist.Work, timeout: timedelta) -> None:
        work.wait(timeout)

    def wait_for_enqueued(self, timeout_s: float) -> bool:
        return True  # each broadcast completed before it returned


class NcclCollectives(Collectives):
    device_type = "cuda"

    def connect(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.Backend:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout * _WATCHDOG_FACTOR
        return dist.ProcessGroupNCCL(store, rank, world_size, options)

    def await_broadcast(self, work: dist.Work, timeout: timedelta) -> None:
        work.wait()  # makes the current stream wait for NCCL's; the CPU goes on

    def wait_for_enqueued(self, timeout_s: float) -> bool:
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_EVENT_POLL_S)
        return True

    def retry_helps(self, error: RuntimeError) -> bool:
        # torch hands NCCL's result code on as text alone (DistBackendError): its words are all there is to read
        return not any(word in str(error) for word in _INVALID_USAGE)

    def abort(self, process_group: dist.Backend) -> None:
        try:
            process_group.abort()  # ncclCommAbort
        except RuntimeError as error:  # already torn down by NCCL itself; nothing left to free
            log.debug("aborting an NCCL communicator: %s", error)
