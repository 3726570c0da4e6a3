"""bench_weight_sync's phases of a LoRA round: the adapter's staging is adapter_stage, and the seconds the workers
report from inside it are adapter_receive and adapter_load (the slowest worker's each, as the server answers them);
the switch between two engine steps is adapter_switch."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from asyncrl.config.sections import LoraConfig
from rollout_servers import vllm_compat
from rollout_servers.adapter import Flip, ServedAdapter
from scripts.bench_weight_sync import time_update_phases


class Adapter(ServedAdapter):
    """The server's adapter with its two calls to vLLM stood in for: staging takes 10 ms, the switch 5 ms."""

    async def stage(self, llm, update_info, deadline_s) -> dict[str, float]:
        await asyncio.sleep(0.01)
        return {"adapter_receive": 0.003, "adapter_load": 0.005}

    async def flip(self, llm) -> Flip:
        await asyncio.sleep(0.005)
        return Flip({}, 0.0001)


def test_a_lora_rounds_phases_are_its_staging_what_the_workers_report_and_its_switch(monkeypatch):
    for name in ("pause_keeping_requests", "start_update", "finish_update"):  # restored after the test
        monkeypatch.setattr(vllm_compat, name, getattr(vllm_compat, name))
    for name in ("stage", "flip"):
        monkeypatch.setattr(ServedAdapter, name, getattr(Adapter, name))
    engine = SimpleNamespace(llm=SimpleNamespace(update_weights=None, resume_generation=None))
    phases = time_update_phases(engine, lora=True)
    adapter = ServedAdapter(LoraConfig(enabled=True))
    assert asyncio.run(adapter.stage(None, {}, 1.0)) == {"adapter_receive": 0.003, "adapter_load": 0.005}
    asyncio.run(adapter.flip(None))
    assert phases["adapter_stage"] >= 0.01 and phases["adapter_switch"] >= 0.005
    assert (phases["adapter_receive"], phases["adapter_load"]) == (0.003, 0.005)
