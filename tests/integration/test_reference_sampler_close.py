"""A closed `ReferenceSampler` (the engine of the synchronous run and of `asyncrl evaluate`) leaves nothing pending on
its event loop: vLLM's output handler, left waiting there, was destroyed mid-wait when the sampler was collected (an
error from the closed loop in the log of every evaluation), and collecting it part by part on CPU blocked for good in
ZeroMQ's context teardown."""

import subprocess
import sys

import pytest

from run_helpers import tiny_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CLOSE_THEN_COLLECT = """
import gc, sys
from asyncrl.config.loader import load_config
from asyncrl.weight_transfer.backends import group_backend
from rollout_servers.reference_sampler import ReferenceSampler

if __name__ == "__main__":  # vLLM's engine core is a spawned process: it imports this module again
    sampler = ReferenceSampler.start(load_config(None, sys.argv[1:]), None, group_backend(receiver_has_own_gpus=False))
    sampler.close()
    del sampler
    gc.collect()
    print("COLLECTED", flush=True)
"""
COLLECT_TIMEOUT_S = 240  # engine start on the loaded box, then the close: a collect that blocks runs into it


def test_a_closed_sampler_is_collected_at_once_and_leaves_no_task_pending(tiny_job_inputs, tmp_path):
    script = tmp_path / "close_then_collect.py"
    script.write_text(CLOSE_THEN_COLLECT)
    overrides = [*tiny_job(tiny_job_inputs, 1), f"run.root_dir={tmp_path / 'runs'}"]
    done = subprocess.run([sys.executable, str(script), *overrides], capture_output=True, text=True,
                          timeout=COLLECT_TIMEOUT_S)
    assert done.returncode == 0 and "COLLECTED" in done.stdout, done.stderr[-3000:]
    assert "Task was destroyed but it is pending" not in done.stderr
    assert "output_handler failed" not in done.stderr
