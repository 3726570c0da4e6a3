"""The README's two commands (`asyncrl learner`, `asyncrl rollout`, same run.name) as one job whose length and
validation schedule are given to the learner alone; real processes, one job.

- `asyncrl learner` stopped by a signal to it alone stops its ranks and its buffer.
- A server killed outright is restarted; a SIGINT to `asyncrl rollout` alone while that restart starts its vLLM
  engine (whose engine core ignores SIGTERM until it has started) stops every process below it.
- A second `asyncrl rollout` takes the job's settings from the learner's config; the learner asks it for the
  validation of its final version (no multiple of validation.every) and, once done, ends it: it exits 0 within
  30 s of the learner, naming the final step, and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from run_helpers import alive, descendants, kill_tree, tiny_job
from waiting import holds_within, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOTAL_STEPS = 12  # given to the learner only
VALIDATE_EVERY = 5  # given to the learner only: the final version, 12, is no multiple of it
WAIT_BOUND_S = 600  # engine starts and training on a loaded 2-core box
END_BOUND_S = 30  # `asyncrl rollout` ends this soon after the learner
STOP_BOUND_S = 90  # the supervisor gives its servers rollout.stop_timeout_s=30 s; slack for a loaded box
POLL_S = 0.2


def _start(command: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", command, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=os.environ.copy())


def _wait_for(condition, what: str, *watched: subprocess.Popen):
    def exited_one() -> str | None:
        return next((f"{p.args[3]} exited with {p.returncode}" for p in watched if p.poll() is not None), None)

    return wait_until(condition, WAIT_BOUND_S, what, poll_s=POLL_S, give_up=exited_one)


def _servers(supervisor: subprocess.Popen) -> list[psutil.Process]:
    """The supervisor's server processes (its other child is multiprocessing's resource tracker)."""
    try:
        children = psutil.Process(supervisor.pid).children()
    except psutil.NoSuchProcess:
        return []
    return [child for child in children if "spawn_main" in " ".join(_cmdline(child))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.NoSuchProcess:
        return []


def _engine_core_below(pid: int) -> bool:
    return any("VLLM::EngineCore" in " ".join(_cmdline(psutil.Process(child))) for child in alive(descendants(pid)))


def _gone(tree: set[int]) -> set[int]:
    """What of `tree` is still alive once it has had STOP_BOUND_S to go."""
    holds_within(lambda: not alive(tree), STOP_BOUND_S, POLL_S)
    return alive(tree)


@pytest.fixture(scope="module")
def job_dir(tiny_job_inputs) -> Path:
    return tiny_job_inputs  # the shared task files and model; this module's run names are its own


def test_a_stop_signal_to_asyncrl_learner_alone_stops_its_ranks_and_buffer(job_dir):
    # as a process manager stops it (not a terminal's Ctrl-C to the whole group), while it waits for servers
    learner = _start("learner", tiny_job(job_dir, TOTAL_STEPS, "run.name=learner-alone"))
    try:
        endpoints = job_dir / "runs" / "learner-alone" / "endpoints.json"
        _wait_for(endpoints.is_file, "the learner's services", learner)
        tree = descendants(learner.pid)
        learner.send_signal(signal.SIGINT)
        _, stderr = learner.communicate(timeout=STOP_BOUND_S)
        assert learner.returncode == 130, stderr[-3000:]
        assert not _gone(tree), f"left behind: {alive(tree)}"
    finally:
        kill_tree(learner.pid)


def test_two_commands_restart_stop_and_end_together(job_dir):
    job = tiny_job(job_dir, TOTAL_STEPS, "run.name=two")
    learner_only = [f"validation.every={VALIDATE_EVERY}", "validation.n=2", "validation.k=2"]
    rollout_args = [arg for arg in job if not arg.startswith("learner.total_steps=")]
    run_dir, started = job_dir / "runs" / "two", []
    try:
        learner = _start("learner", [*job, *learner_only])
        started.append(learner)
        rollout = _start("rollout", rollout_args)
        started.append(rollout)
        metrics = run_dir / "metrics.jsonl"
        first = _wait_for(lambda: _servers(rollout), "rollout server", learner, rollout)[0]
        _wait_for(lambda: _engine_core_below(first.pid), "the first server's engine core", learner, rollout)
        first.kill()  # a crash, while its engine starts: the supervisor restarts it after its back-off
        restarted = _wait_for(lambda: [s for s in _servers(rollout) if s.pid != first.pid], "restarted server", rollout)
        _wait_for(lambda: _engine_core_below(restarted[0].pid), "the restarted server's engine core", rollout)
        tree = descendants(rollout.pid)
        rollout.send_signal(signal.SIGINT)  # to it alone, as a process manager would
        _, stderr = rollout.communicate(timeout=STOP_BOUND_S)
        assert rollout.returncode == 130, stderr[-3000:]
        assert not _gone(tree), f"left behind by the stopped rollout: {alive(tree)}"

        rollout = _start("rollout", rollout_args)  # the learner waits for servers before its first step
        started.append(rollout)
        _, learner_err = learner.communicate(timeout=WAIT_BOUND_S)
        assert learner.returncode == 0, learner_err[-3000:]
        learner_done = time.monotonic()
        tree = descendants(rollout.pid)
        _, rollout_err = rollout.communicate(timeout=END_BOUND_S + STOP_BOUND_S)
        rollout_took = time.monotonic() - learner_done
        assert rollout.returncode == 0, rollout_err[-3000:]
        assert rollout_took < END_BOUND_S, rollout_took
        assert f"the learner finished the job at step {TOTAL_STEPS}: the rollout servers are stopped" in rollout_err
        assert f"learner.total_steps={TOTAL_STEPS}" in rollout_err  # taken from the learner's config, and said so
        assert not _gone(tree), f"left behind by the finished rollout: {alive(tree)}"
        last = json.loads(metrics.read_text().splitlines()[-1])
        assert last["step"] == TOTAL_STEPS and "val/score/mean" in last, last  # the final version's validation
        # a killed server is a fault its supervisor handles: warnings, and no error or traceback in any log
        for log in [*(run_dir / "logs").iterdir(), run_dir / "buffer.log"]:
            text = log.read_text()
            assert " ERROR " not in text and "Traceback" not in text, f"{log}: {text[-3000:]}"
    finally:
        for process in started:
            kill_tree(process.pid)
