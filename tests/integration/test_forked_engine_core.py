"""On CPU a rollout server forks its vLLM engine core (`forks_engine_core`): the forked core computes on the threads
`rollout.engine.cpu_threads` asks for, as a spawned one does (a forked core keeps its parent's torch thread count,
and a core on every core oversubscribed the 2-core box its jobs share); and the GPU's start turn the engine started
in is free once the start ends, though the forked core lives on sharing the turn's lock file (on a GPU vLLM forks
its core too: the second server of an H100 waited for the first one's whole job). The fatal-error record of a forked
core is `test_run_signals.py`'s engine-refused job."""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ENGINE_IN_A_FRESH_PROCESS = """
import asyncio, os, sys
from pathlib import Path
import psutil
from asyncrl.config.rollout import EngineConfig, RolloutConfig
from asyncrl.file_lock import FileLock
from rollout_servers.engine import RolloutEngine
from rollout_servers.engine_turns import engine_start_turn

def torch_threads(worker):
    import torch
    return torch.get_num_threads()

async def main():
    config = RolloutConfig(max_inflight=4, engine=EngineConfig(dtype="float32", max_model_len=64, cpu_threads=1))
    with engine_start_turn([0], 60.0, "server-0", Path(sys.argv[2])):  # as a server on GPU 0 takes it
        engine = await RolloutEngine.start(sys.argv[1], config, process_is_fresh=True)
    cores = await engine.llm.collective_rpc(torch_threads)
    forked = any(child.name().startswith("VLLM") for child in psutil.Process().children())
    print("CORE", cores[0], forked, flush=True)
    # a lock of its own on the file, as the next server's start takes it: held by the forked core, it is refused
    print("TURN", FileLock(Path(sys.argv[2]) / "gpu0.lock").take(0.0, lambda holder: None), flush=True)
    engine.shutdown()

asyncio.run(main())
os._exit(0)
"""


@pytest.fixture(scope="module")
def engine_lines(tiny_models, tmp_path_factory) -> dict[str, list[str]]:
    """What the fresh process printed, by its lines' first word: one engine start serves both tests."""
    turns = tmp_path_factory.mktemp("turns")
    done = subprocess.run([sys.executable, "-c", ENGINE_IN_A_FRESH_PROCESS, str(tiny_models.served_dir), str(turns)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # a function for the core
    lines = {row.split()[0]: row.split() for row in done.stdout.splitlines() if row.startswith(("CORE", "TURN"))}
    assert set(lines) == {"CORE", "TURN"}, done.stderr[-3000:]
    return lines


def test_a_forked_engine_core_computes_on_the_threads_the_config_asks_for(engine_lines):
    assert engine_lines["CORE"] == ["CORE", "1", "True"]  # this test process itself computes on 2


def test_the_gpu_s_start_turn_is_free_once_the_start_ends_while_the_forked_core_runs(engine_lines):
    assert engine_lines["CORE"][2] == "True"  # the core was forked while the turn was held
    assert engine_lines["TURN"] == ["TURN", "True"]
