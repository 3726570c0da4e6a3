"""On CPU a rollout server forks its vLLM engine core (`forks_engine_core`): the forked core computes on the threads
`rollout.engine.cpu_threads` asks for, as a spawned one does (a forked core keeps its parent's torch thread count,
and a core on every core oversubscribed the 2-core box its jobs share). The fatal-error record of a forked core is
`test_run_signals.py`'s engine-refused job."""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ENGINE_IN_A_FRESH_PROCESS = """
import asyncio, os, sys
import psutil
from asyncrl.config.rollout import EngineConfig, RolloutConfig
from rollout_servers.engine import RolloutEngine

def torch_threads(worker):
    import torch
    return torch.get_num_threads()

async def main():
    config = RolloutConfig(max_inflight=4, engine=EngineConfig(dtype="float32", max_model_len=64, cpu_threads=1))
    engine = await RolloutEngine.start(sys.argv[1], config, process_is_fresh=True)
    cores = await engine.llm.collective_rpc(torch_threads)
    forked = any(child.name().startswith("VLLM") for child in psutil.Process().children())
    print("CORE", cores[0], forked, flush=True)
    engine.shutdown()

asyncio.run(main())
os._exit(0)
"""


def test_a_forked_engine_core_computes_on_the_threads_the_config_asks_for(tiny_models):
    done = subprocess.run([sys.executable, "-c", ENGINE_IN_A_FRESH_PROCESS, str(tiny_models.served_dir)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # a function for the core
    line = [row for row in done.stdout.splitlines() if row.startswith("CORE")]
    assert line, done.stderr[-3000:]
    assert line[0].split() == ["CORE", "1", "True"]  # this test process itself computes on 2
