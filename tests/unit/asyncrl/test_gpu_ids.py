"""GPU ids without torch: a machine without an NVIDIA driver sees no GPU, and saying so loads no torch; with a
driver, NVML's count read through CUDA_VISIBLE_DEVICES as CUDA reads it (the physical ids); `rollout.gpus` is cut
into each server's tensor-parallel GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl import gpu_ids
from asyncrl.config import load_config

ROOT = Path(__file__).resolve().parents[3]


def test_without_a_driver_no_gpu_is_visible_and_torch_is_not_loaded():
    probe = ("import sys; from asyncrl import gpu_ids; gpu_ids.NVML_LIBRARY = 'libno-such-driver.so.1'; "
             "print(gpu_ids.visible_gpus(), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          check=True)
    assert done.stdout.strip() == "[] False"


class FakeNvml:
    """NVIDIA's management library as ctypes loads it, on a machine of `gpus` GPUs."""

    def __init__(self, gpus: int):
        self.gpus, self.open = gpus, False

    def nvmlInit_v2(self) -> int:
        self.open = True
        return gpu_ids.NVML_SUCCESS

    def nvmlDeviceGetCount_v2(self, count) -> int:
        count._obj.value = self.gpus
        return gpu_ids.NVML_SUCCESS

    def nvmlShutdown(self) -> int:
        self.open = False
        return gpu_ids.NVML_SUCCESS


@pytest.mark.parametrize(("listed", "visible"), [
    (None, [0, 1, 2, 3, 4, 5, 6, 7]),
    ("5,7", [5, 7]),
    (" 5, 7 ", [5, 7]),
    ("5,7,9,1", [5, 7]),  # CUDA reads the list up to its first id that names no GPU
    ("5,GPU-8f1c,1", [5]),
    ("", []),
    ("5,7,5", []),  # an id listed twice: CUDA sees none
])
def test_with_a_driver_the_visible_ids_are_the_listed_ones_cuda_reads(monkeypatch, listed, visible):
    nvml = FakeNvml(gpus=8)
    monkeypatch.setattr(gpu_ids.ctypes, "CDLL", lambda name: nvml)
    if listed is None:
        monkeypatch.delenv(gpu_ids.VISIBLE_DEVICES, raising=False)
    else:
        monkeypatch.setenv(gpu_ids.VISIBLE_DEVICES, listed)
    assert gpu_ids.visible_gpus() == visible
    assert not nvml.open


def test_where_the_drivers_library_does_not_answer_torch_counts_the_listed_ones(monkeypatch):
    import torch

    nvml = FakeNvml(gpus=8)
    monkeypatch.setattr(nvml, "nvmlInit_v2", lambda: 9)  # NVML_ERROR_DRIVER_NOT_LOADED
    monkeypatch.setattr(gpu_ids.ctypes, "CDLL", lambda name: nvml)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv(gpu_ids.VISIBLE_DEVICES, "5,7,9")  # three listed, two counted
    assert gpu_ids.visible_gpus() == [5, 7]
    monkeypatch.delenv(gpu_ids.VISIBLE_DEVICES)
    assert gpu_ids.visible_gpus() == [0, 1]


def test_rollout_gpus_are_cut_into_each_servers_tensor_parallel_gpus():
    config = load_config(None, ["rollout.num_servers=2", "rollout.gpus=[4,5,6,7]", "rollout.engine.tensor_parallel_size=2"])
    assert gpu_ids.listed_server_gpus(config) == ((4, 5), (6, 7))
    assert gpu_ids.listed_server_gpus(load_config(None, [])) == ()
