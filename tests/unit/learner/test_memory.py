"""Micro-batch sizing from measured memory (hand-computed fits), the CPU's auto value, and an out-of-memory
error that names the keys to change."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config.learner import LearnerConfig
from learner.distributed import World
from learner.memory import (
    CPU_MICRO_BATCH_TOKENS, MAX_AUTO_TOKENS, SHARED_GPU_USABLE_SHARE, USABLE_SHARE, LearnerOutOfMemory, fit_budget, out_of_memory_names_keys,
    resolve_micro_batch_tokens,
)

MIB, GIB = 2**20, 2**30
CPU_WORLD = World(rank=0, size=1, device=torch.device("cpu"))


def test_the_budget_is_the_line_through_the_two_probes():
    # 10 GiB resident; 1 MiB per token; 2 GiB more whatever the size; 40 GiB free, 6 GiB of optimizer state ahead
    peaks = [10 * GIB + 2 * GIB + 2048 * MIB, 10 * GIB + 2 * GIB + 4096 * MIB]
    fit = fit_budget((2048, 4096), peaks, resident=10 * GIB, available=40 * GIB, optimizer_state=6 * GIB)
    assert fit.per_token == pytest.approx(MIB)
    assert fit.fixed == pytest.approx(2 * GIB)
    expected = int((40 * GIB * USABLE_SHARE - 6 * GIB - 2 * GIB) / MIB) // 1024 * 1024
    assert fit.tokens == expected == 26624  # 26.0 GiB of room → 26,624 tokens, a multiple of 1,024
    shared = fit_budget((2048, 4096), peaks, resident=10 * GIB, available=40 * GIB, optimizer_state=6 * GIB,
                        usable_share=SHARED_GPU_USABLE_SHARE)
    assert shared.tokens == int((40 * GIB * 0.7 - 8 * GIB) / MIB) // 1024 * 1024 == 20480  # a shared GPU keeps more back


def test_a_peak_that_does_not_grow_with_the_probe_takes_the_slope_of_what_the_forward_saved():
    # a large model: both probes peak at the end of the backward (12 GiB of gradients), while the forward kept
    # 2 MiB per token for the backward; the peaks' own line would see no cost per token at all
    peaks = [30 * GIB, 30 * GIB]
    saved = [2048 * 2 * MIB, 4096 * 2 * MIB]
    fit = fit_budget((2048, 4096), peaks, resident=14 * GIB, available=110 * GIB, optimizer_state=20 * GIB, saved=saved)
    assert fit.per_token == pytest.approx(2 * MIB)
    assert fit.fixed == pytest.approx(16 * GIB - 2048 * 2 * MIB)  # what the smaller probe needed beyond the line
    assert fit.tokens == 30720  # (110 GiB · 0.85 - 20 - 12) / 2 MiB = 31,488, rounded down to a multiple of 1,024


def test_the_budget_is_capped_and_never_negative():
    roomy = fit_budget((2048, 4096), [GIB + 2048, GIB + 4096], resident=GIB, available=80 * GIB, optimizer_state=0)
    assert roomy.tokens == MAX_AUTO_TOKENS
    full = fit_budget((2048, 4096), [GIB, 2 * GIB], resident=0, available=GIB, optimizer_state=GIB)
    assert full.tokens == 0


def test_auto_on_cpu_and_a_number_as_configured():
    model = torch.nn.Linear(2, 2)
    assert resolve_micro_batch_tokens(model, LearnerConfig(), CPU_WORLD, 10, 64, packed=False) == CPU_MICRO_BATCH_TOKENS
    configured = LearnerConfig(micro_batch_tokens="12288")
    assert resolve_micro_batch_tokens(model, configured, CPU_WORLD, 10, 64, packed=True) == 12288


def test_out_of_memory_names_the_keys_to_change():
    with pytest.raises(LearnerOutOfMemory) as raised:
        with out_of_memory_names_keys(32768):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    message = str(raised.value)
    for key in ("learner.micro_batch_tokens", "learner.activation_checkpointing", "learner.cpu_offload", "32768"):
        assert key in message
    assert "Tried to allocate 2.00 GiB" in message and "more detail" not in message
