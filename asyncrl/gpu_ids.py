"""GPU ids without torch: which GPUs this process sees, pinning a process to some, and each server's GPUs as
`rollout.gpus` lists them. The rollout command starts its servers' processes with these before it imports torch
itself (seconds of a job's start), so nothing here imports torch unless a GPU driver is there to ask."""

from __future__ import annotations

import ctypes
import os

from asyncrl.config import AsyncRLConfig

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
NVML_LIBRARY = "libnvidia-ml.so.1"  # installed with every NVIDIA driver: without it no GPU can be visible


def visible_gpus() -> list[int]:
    """Physical ids of the GPUs this process may use (CUDA_VISIBLE_DEVICES, else every GPU torch counts); none,
    without importing torch, where no NVIDIA driver is installed."""
    if not nvidia_driver_installed():
        return []
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get(VISIBLE_DEVICES)
    if listed is None:
        return list(range(count))
    ids = [int(part) for part in listed.split(",") if part.strip().isdigit()]
    return ids[:count]


def nvidia_driver_installed() -> bool:
    """Whether NVIDIA's management library loads in this process (torch counts GPUs through it)."""
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return False
    return True


def pin(gpus: tuple[int, ...] | list[int]) -> None:
    """Make only `gpus` visible to this process and its children (before CUDA is first used)."""
    os.environ[VISIBLE_DEVICES] = ",".join(str(gpu) for gpu in gpus)


def listed_server_gpus(config: AsyncRLConfig) -> tuple[tuple[int, ...], ...]:
    """`rollout.gpus` cut into each server's `rollout.engine.tensor_parallel_size` GPUs, in the listed order."""
    tp = config.rollout.engine.tensor_parallel_size
    listed = config.rollout.gpus
    return tuple(tuple(listed[i:i + tp]) for i in range(0, len(listed), tp))
