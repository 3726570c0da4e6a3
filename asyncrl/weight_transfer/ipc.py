"""Same-GPU weight transfer through CUDA IPC: one buffer that the learner fills and the servers read.

When the learner and a rollout server share a GPU (colocated), NCCL refuses two ranks on one device and
gloo goes through CPU memory (about 0.5 s per sync of a 0.5B model). Instead the learner keeps every
weight of a round in one flat buffer on its GPU, exports that buffer once as a CUDA IPC handle, and copies
each round's weights into it, device to device, before the servers are invited. A server maps the buffer
once (while the handle stays the same) and loads each tensor from a view of it.

The order of a round keeps this safe: the learner's copies complete before the invitation leaves, and
the next round's copies start only after every invited server answered or was left out (a server left
out mid-load may hold mixed weights; it is marked for catch-up like any failed round).

The handle travels as plain fields (base64 text for the bytes), never as a pickle: torch's own
`storage._share_cuda_()` / `UntypedStorage._new_shared_cuda` pair, which `torch.multiprocessing` uses
for CUDA tensors, produces and consumes them.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Sequence

import torch

from asyncrl.weight_transfer.group import WeightTransferError

log = logging.getLogger(__name__)

ALIGN_BYTES = 256  # every tensor starts at a multiple of this in the buffer (aligned vector loads on both sides)
OTHER_GPU = "ipc: the server is not on the learner's GPU"  # what a server elsewhere answers (no retry fixes it)


@dataclass(frozen=True)
class IpcHandle:
    """What a server needs to map the learner's buffer; plain fields, so it travels in the init request."""

    gpu_uuid: str  # the physical GPU holding the buffer: a server elsewhere refuses to map it
    handle: str  # base64 of the CUDA IPC memory handle of the buffer's allocation
    size_bytes: int  # the buffer's size
    offset_bytes: int  # where the buffer starts inside that allocation
    ref_counter_handle: str  # base64 of torch's shared reference counter (keeps the allocation alive while mapped)
    ref_counter_offset: int
    event_handle: str  # base64 of the IPC event the mapping waits on (the buffer's creation), may be empty
    event_sync_required: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def byte_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the buffer (aligned to ALIGN_BYTES) and the buffer's size, for tensors of
    `sizes` bytes in order. Both sides compute it from the update's tensor list, so no offsets travel."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // ALIGN_BYTES) * ALIGN_BYTES
        offsets.append(start)
        end = start + size
    return offsets, end


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class SharedWeights:
    """The learner's side: the buffer on its current CUDA device, exported once, rewritten each round; made anew
    (and exported again) only when a round's weights no longer fit."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None  # [size_bytes] uint8
        self._handle: IpcHandle | None = None

    @property
    def handle(self) -> IpcHandle:
        if self._handle is None:
            raise RuntimeError("SharedWeights.handle before reserve: nothing is exported yet")
        return self._handle

    def reserve(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Make the buffer large enough for `named_tensors`; True when it was made anew, so that its new handle
        must reach the servers."""
        _, size = byte_layout([t.numel() * t.element_size() for _, t in named_tensors])
        if self._buffer is not None and self._buffer.numel() >= size:
            return False
        self._buffer, self._handle = None, None  # the old allocation goes before the new one is made
        device = torch.device("cuda", torch.cuda.current_device())
        self._buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self._handle = _export(self._buffer)
        log.info("sharing a %.1f MiB weight buffer on %s through CUDA IPC", size / 2**20, device)
        return True

    def write(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> float:
        """Copy every tensor into its place and wait until the copies are done (the servers read as soon as
        they are invited); returns the seconds it took. Call `reserve` first."""
        assert self._buffer is not None, "write before reserve"
        started = time.perf_counter()
        pack_into(self._buffer, named_tensors)
        torch.cuda.synchronize(self._buffer.device)
        return time.perf_counter() - started

    def close(self) -> None:
        self._buffer, self._handle = None, None
        torch.cuda.ipc_collect()  # frees the allocation once no server maps it any more


def pack_into(buffer: torch.Tensor, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Copy each tensor (full and contiguous, on any device) into its `byte_layout` place in `buffer` ([bytes]
    uint8); the copies are queued on the buffer's device, not waited for."""
    offsets, _ = byte_layout([t.numel() * t.element_size() for _, t in named_tensors])
    for (_, tensor), offset in zip(named_tensors, offsets):
        nbytes = tensor.numel() * tensor.element_size()
        buffer[offset:offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8), non_blocking=True)


class SharedWeightsReader:
    """A server's side: the learner's buffer mapped into this process, read as the update's tensors."""

    def __init__(self, buffer: torch.Tensor, handle: IpcHandle | None = None) -> None:
        self.buffer = buffer  # [size_bytes] uint8, on this server's device
        self.handle = handle  # what it was mapped from (None: a local buffer, in unit tests)
        self.device = buffer.device
        self._layout: tuple = ()  # (name, dtype, shape) of each tensor of the last update read
        self._views: list[tuple[str, torch.Tensor]] = []  # that update's views of the buffer

    @classmethod
    def open(cls, fields: dict[str, Any], device: torch.device, previous: SharedWeightsReader | None = None) -> SharedWeightsReader:
        """Map the buffer `fields` describe on `device` (the same physical GPU, else WeightTransferError), or keep
        `previous` when it maps that very buffer already."""
        handle = IpcHandle(**fields)
        if previous is not None and previous.handle == handle:
            return previous
        local = gpu_uuid(device)
        if handle.gpu_uuid != local:
            raise WeightTransferError(f"{OTHER_GPU} (buffer on GPU {handle.gpu_uuid}, server on {local}); "
                                      "rollout.weight_sync.backend=ipc needs them colocated: use nccl",
                                      retry_helps=False)
        return cls(_import(handle, device), handle)

    def tensors(self, metas: Sequence[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view) of each announced tensor (`TensorMeta`s in order), as `whole_round` holds them."""
        return iter(self.whole_round(metas))

    def whole_round(self, metas: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of every announced tensor: views of the shared buffer, whose values are the learner's latest
        round until its next, which starts only after this server answered. The views are made once and reused
        while the announced tensors stay the same (every round of a run): made anew, they cost three torch calls per
        tensor inside the engine's pause, each through vLLM's device mode (873 calls per round for a 0.5B model's
        291 tensors). The list is shared between rounds: read it, never change it."""
        layout = tuple((meta.name, meta.dtype, tuple(meta.shape)) for meta in metas)
        if layout != self._layout:
            self._views, self._layout = self._views_of(layout), layout
        return self._views

    def _views_of(self, layout: tuple) -> list[tuple[str, torch.Tensor]]:
        offsets, size = byte_layout([tensor_bytes(shape, dtype) for _, dtype, shape in layout])
        if size > self.buffer.numel():
            raise WeightTransferError(f"the update needs {size} bytes and the shared buffer holds {self.buffer.numel()}")
        return [(name, self.buffer[offset:offset + tensor_bytes(shape, dtype)].view(dtype).view(shape))
                for (name, dtype, shape), offset in zip(layout, offsets)]

    def synchronize(self) -> None:
        """Wait until the loads from the buffer are done: the learner may overwrite it once this server answers."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.buffer, self._views = None, []  # type: ignore[assignment]


def _export(buffer: torch.Tensor) -> IpcHandle:
    storage = buffer.untyped_storage()
    (_, handle, size, offset, counter, counter_offset, event, event_sync) = storage._share_cuda_()
    return IpcHandle(gpu_uuid(buffer.device), _text(handle), int(size), int(offset), _text(counter), int(counter_offset),
                     _text(event), bool(event_sync))


def _import(handle: IpcHandle, device: torch.device) -> torch.Tensor:
    torch.cuda.set_device(device)
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index, _bytes(handle.handle), handle.size_bytes, handle.offset_bytes, _bytes(handle.ref_counter_handle),
        handle.ref_counter_offset, _bytes(handle.event_handle), handle.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _text(raw: bytes | None) -> str:
    return base64.b64encode(raw or b"").decode("ascii")


def _bytes(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))
