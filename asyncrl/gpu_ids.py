"""GPU ids without torch: which GPUs this process sees, pinning a process to some, and each server's GPUs as
`rollout.gpus` lists them. The rollout command starts its servers' processes with these before it imports torch
itself (seconds of a job's start), and `asyncrl run` plans the job with them: nothing here imports torch while
NVIDIA's management library answers."""

from __future__ import annotations

import ctypes
import os
import sys

from asyncrl.config import AsyncRLConfig

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
NVML_LIBRARY = "libnvidia-ml.so.1"  # installed with every NVIDIA driver: without it no GPU can be visible
NVML_SUCCESS = 0  # nvmlReturn_t of a call that worked


def visible_gpus() -> list[int]:
    """Physical ids of the GPUs this process may use: CUDA_VISIBLE_DEVICES's as CUDA reads it (`read_as_cuda`), else
    every installed GPU; none where no NVIDIA driver is installed. Counted by NVIDIA's management library, as torch
    counts them, without importing torch (seconds of a job's start on a GPU host); where that library loads but does
    not answer, by torch (which then asks CUDA itself, and counts only the visible GPUs)."""
    installed = installed_gpu_count()
    listed = os.environ.get(VISIBLE_DEVICES)
    if installed is not None:
        return list(range(installed)) if listed is None else read_as_cuda(listed, installed)
    import torch

    visible = torch.cuda.device_count()
    return list(range(visible)) if listed is None else read_as_cuda(listed, sys.maxsize)[:visible]


def read_as_cuda(listed: str, installed: int) -> list[int]:
    """CUDA_VISIBLE_DEVICES's ids as CUDA and torch read them on a machine of `installed` GPUs: up to the first that
    names none of them, and none at all where one is listed twice."""
    ids: list[int] = []
    for part in (part.strip() for part in listed.split(",")):
        if not part.isdigit() or int(part) >= installed:
            break
        if int(part) in ids:
            return []
        ids.append(int(part))
    return ids


def installed_gpu_count() -> int | None:
    """The GPUs NVIDIA's management library counts on this machine, whatever CUDA_VISIBLE_DEVICES says: 0 where the
    library (installed with every NVIDIA driver) does not load, None where it loads but does not answer."""
    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return 0
    if nvml.nvmlInit_v2() != NVML_SUCCESS:
        return None
    try:
        count = ctypes.c_uint(0)
        return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == NVML_SUCCESS else None
    finally:
        nvml.nvmlShutdown()


def pin(gpus: tuple[int, ...] | list[int]) -> None:
    """Make only `gpus` visible to this process and its children (before CUDA is first used)."""
    os.environ[VISIBLE_DEVICES] = ",".join(str(gpu) for gpu in gpus)


def listed_server_gpus(config: AsyncRLConfig) -> tuple[tuple[int, ...], ...]:
    """`rollout.gpus` cut into each server's `rollout.engine.tensor_parallel_size` GPUs, in the listed order."""
    tp = config.rollout.engine.tensor_parallel_size
    listed = config.rollout.gpus
    return tuple(tuple(listed[i:i + tp]) for i in range(0, len(listed), tp))
