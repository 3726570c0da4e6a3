"""bench_weight_sync's phases of a LoRA round: the workers' one RPC is adapter_swap, and the seconds the workers
report from inside it are adapter_receive and adapter_load, the slowest worker's each; vLLM's other RPCs (the join's)
go through untimed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rollout_servers import vllm_compat
from rollout_servers.adapter import RECEIVE_METHOD
from scripts.bench_weight_sync import time_update_phases


class LLM:
    """Stands in for AsyncLLM: the calls a LoRA round makes, two workers answering the adapter's RPC."""

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[dict[str, float] | None]:
        if method != RECEIVE_METHOD:  # vLLM's own, e.g. joining the weight-sync group
            return [None, None]
        await asyncio.sleep(0.01)
        return [{"adapter_receive": 0.002, "adapter_load": 0.005}, {"adapter_receive": 0.003, "adapter_load": 0.004}]

    async def update_weights(self, request) -> None: ...

    async def resume_generation(self) -> None: ...


def test_a_lora_rounds_phases_are_the_workers_rpc_and_what_the_workers_report(monkeypatch):
    for name in ("pause_keeping_requests", "start_update", "finish_update"):  # restored after the test
        monkeypatch.setattr(vllm_compat, name, getattr(vllm_compat, name))
    engine = SimpleNamespace(llm=LLM())
    phases = time_update_phases(engine, lora=True)
    assert asyncio.run(engine.llm.collective_rpc("init_weight_transfer_engine")) == [None, None]
    assert phases == {}  # vLLM's own RPCs go through untimed
    answers = asyncio.run(engine.llm.collective_rpc(RECEIVE_METHOD, args=({}, {})))
    assert len(answers) == 2  # the workers' answers still reach the caller
    assert phases["adapter_swap"] >= 0.01
    assert (phases["adapter_receive"], phases["adapter_load"]) == (0.003, 0.005)
