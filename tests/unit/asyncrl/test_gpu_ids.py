"""GPU ids without torch: a machine without an NVIDIA driver sees no GPU, and saying so loads no torch; with a
driver the count is torch's (CUDA_VISIBLE_DEVICES naming the physical ids); `rollout.gpus` is cut into each
server's tensor-parallel GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from asyncrl import gpu_ids
from asyncrl.config import load_config

ROOT = Path(__file__).resolve().parents[3]


def test_without_a_driver_no_gpu_is_visible_and_torch_is_not_loaded():
    probe = ("import sys; from asyncrl import gpu_ids; gpu_ids.NVML_LIBRARY = 'libno-such-driver.so.1'; "
             "print(gpu_ids.visible_gpus(), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          check=True)
    assert done.stdout.strip() == "[] False"


def test_with_a_driver_the_visible_ids_are_torchs_count_of_the_listed_ones(monkeypatch):
    import torch

    monkeypatch.setattr(gpu_ids, "nvidia_driver_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7,9")  # three listed, two counted (one is gone)
    assert gpu_ids.visible_gpus() == [5, 7]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_ids.visible_gpus() == [0, 1]


def test_rollout_gpus_are_cut_into_each_servers_tensor_parallel_gpus():
    config = load_config(None, ["rollout.num_servers=2", "rollout.gpus=[4,5,6,7]", "rollout.engine.tensor_parallel_size=2"])
    assert gpu_ids.listed_server_gpus(config) == ((4, 5), (6, 7))
    assert gpu_ids.listed_server_gpus(load_config(None, [])) == ()
