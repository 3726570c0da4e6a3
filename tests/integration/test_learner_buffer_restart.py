"""`asyncrl learner` restarts the buffer it started when that buffer is killed outright, and trains on: a real
learner (tiny model, CPU, one rank) with its own buffer, fed by this test as a rollout server would (a
`TrajectoryProducer` on the address in the run's endpoints file; no vLLM). The buffer is killed with SIGKILL
while the learner waits for the batch after a step whose records are handed out but not yet committed. The job
must still finish every step, each version logged once, with a "restarting the buffer" line in the learner's
log, and every acknowledged group trained exactly once: the final commit covers the whole log and nothing past it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from asyncrl.endpoints import ENDPOINTS_FILE
from asyncrl.transport import TrajectoryProducer
from learner_helpers import random_groups, save_tiny_model
from run_helpers import alive, descendants, kill_tree
from waiting import exited, wait_until

pytestmark = pytest.mark.slow

TOTAL_STEPS = 6
KILL_AFTER_STEP = 3  # the checkpoint of step 2 committed 2 batches; step 3's batch is handed out, not committed
GROUPS_PER_STEP = 2  # buffer.batch_groups
SAMPLES_PER_GROUP = 2  # rollout.sampling.n
START_BOUND_S = 300  # spawning the rank, importing torch, loading the model on a loaded 2-core box
STEP_BOUND_S = 120  # a few tiny steps, or a buffer restart, on that box
POLL_S = 0.1


def learner_overrides(tmp: Path) -> list[str]:
    return [
        f"run.root_dir={tmp / 'runs'}", "run.name=restart", "metrics.wandb_mode=disabled", f"model.path={tmp / 'model'}",
        "model.dtype=float32", f"learner.total_steps={TOTAL_STEPS}", "learner.checkpoint_every=2", "learner.lr=0.001",
        "learner.torch_threads=1", f"buffer.batch_groups={GROUPS_PER_STEP}", f"rollout.sampling.n={SAMPLES_PER_GROUP}",
        "buffer.max_staleness=100",  # the test's groups are all sampled at version 0: none is dropped as stale
        "rollout.connect_timeout_s=0.1",  # no rollout server joins: train at once
        "buffer.client_timeout_s=15", "buffer.client_resend_s=0.5", "rollout.restart_backoff_s=0.5",
    ]


def feed(address: str, steps: range) -> None:
    """The groups of `steps`' batches, each acknowledged (the producer resends to a restarted buffer)."""
    producer = TrajectoryProducer(address, ack_timeout_s=1.0, deadline_s=STEP_BOUND_S)
    try:
        for step in steps:
            for group in random_groups(seed=step, groups=GROUPS_PER_STEP, samples=SAMPLES_PER_GROUP):
                producer.send(group)
    finally:
        producer.close()


def buffer_address(run_dir: Path) -> str | None:
    """The buffer's address in the endpoints file the learner writes (atomically) once its services listen."""
    path = run_dir / ENDPOINTS_FILE
    return json.loads(path.read_text()).get("buffer") if path.exists() else None


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def buffer_pids(learner: subprocess.Popen) -> list[int]:
    """The `asyncrl buffer` processes below the learner command."""
    found = []
    for pid in alive(descendants(learner.pid)):
        try:
            if "buffer" in psutil.Process(pid).cmdline()[3:4]:  # python -m launch.cli buffer ...
                found.append(pid)
        except psutil.NoSuchProcess:
            pass
    return found


def test_a_killed_buffer_is_restarted_and_the_job_trains_every_step_once(tmp_path):
    save_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "runs" / "restart"
    output = (tmp_path / "learner.out").open("w")
    learner = subprocess.Popen([sys.executable, "-m", "launch.cli", "learner", *learner_overrides(tmp_path)],
                               stdout=output, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy())
    learner_log = run_dir / "logs" / "learner0.log"

    def tail() -> str:
        return "\n".join(path.read_text()[-3000:] for path in (tmp_path / "learner.out", learner_log) if path.exists())

    try:
        address = wait_until(lambda: buffer_address(run_dir), START_BOUND_S, "the learner's buffer address",
                             poll_s=POLL_S, give_up=exited(learner), context=tail)
        feed(address, range(1, KILL_AFTER_STEP + 1))
        wait_until(lambda: KILL_AFTER_STEP in logged_steps(run_dir), START_BOUND_S, f"step {KILL_AFTER_STEP}",
                   poll_s=POLL_S, give_up=exited(learner), context=tail)
        [first_buffer] = buffer_pids(learner)
        os.kill(first_buffer, signal.SIGKILL)  # the learner is waiting for step 4's batch now
        wait_until(lambda: set(buffer_pids(learner)) - {first_buffer}, STEP_BOUND_S, "a restarted buffer",
                   poll_s=POLL_S, give_up=exited(learner), context=tail)
        feed(address, range(KILL_AFTER_STEP + 1, TOTAL_STEPS + 1))
        wait_until(lambda: learner.poll() is not None, STEP_BOUND_S, "the learner's end", poll_s=POLL_S, context=tail)
        assert learner.returncode == 0, tail()
        assert not alive(descendants(learner.pid)), "a process outlived the learner command"
    finally:
        kill_tree(learner.pid)
        learner.wait()
        output.close()

    assert logged_steps(run_dir) == list(range(1, TOTAL_STEPS + 1))  # no step repeated or skipped
    log_text = learner_log.read_text()
    assert "was killed by SIGKILL" in log_text and "restarting the buffer" in log_text, log_text[-3000:]
    assert "restarted the buffer on " + address in log_text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["batch/samples"] == GROUPS_PER_STEP * SAMPLES_PER_GROUP and r["buffer/dropped_stale_in_batch"] == 0
               for r in records)
    committed = json.loads((run_dir / "buffer" / "committed.json").read_text())
    # every group sent was acknowledged, so the log holds exactly these; the final commit is past all of them with
    # none left over, and each step took a full batch of fresh ones: each trained once, none lost
    assert (committed["offset"], committed["ahead"]) == (TOTAL_STEPS * GROUPS_PER_STEP, [])
