"""The README's two commands (`asyncrl learner`, `asyncrl rollout`, same run.name) as one job whose length and
validation schedule are given to the learner alone; real processes, one job.

- `asyncrl learner` stopped by a signal to it alone stops its ranks and its buffer.
- A server killed outright while its vLLM engine core starts takes the engine core along (held still before our
  vLLM plugin loads in it), and is restarted; a SIGINT to `asyncrl rollout` alone while that restart starts its vLLM
  engine (whose engine core ignores SIGTERM until it has started) stops every process below it, and the server
  stops cleanly once its engine is up without ever joining weight sync: the learner trains no step while no server
  serves it.
- A second `asyncrl rollout` takes the job's settings from the learner's config. `asyncrl learner` killed outright
  mid-training and started again (as a process manager would, `learner.resume=auto`) comes back on the same
  addresses: the servers keep their engines (same processes) and training goes on from the checkpoint.
- The learner asks the servers for the validation of its final version (no multiple of validation.every) and,
  once done, ends `asyncrl rollout`: it exits 0 within 30 s of the learner, naming the final step, and leaves no
  process behind.
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

from asyncrl.parent_death import launched_environment
from run_helpers import alive, descendants, kill_tree, tiny_job
from waiting import holds_within, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOTAL_STEPS = 12  # given to the learner only
CHECKPOINT_EVERY = 4  # the restarted learner resumes from the checkpoint of step 4 or 8
KILL_AFTER_STEP = 5  # the learner is killed once it logged this step (a checkpoint behind it)
# The kill comes within one poll (POLL_S) of the learner logging KILL_AFTER_STEP, long before it could log
# TOTAL_STEPS: each of the steps between needs fresh samples from the server and a weight-sync round.
VALIDATE_EVERY = 5  # given to the learner only: the final version, 12, is no multiple of it
WAIT_BOUND_S = 600  # engine starts and training on a loaded 2-core box
END_BOUND_S = 30  # `asyncrl rollout` ends this soon after the learner
STOP_BOUND_S = 90  # the supervisor gives its servers rollout.stop_timeout_s=30 s; slack for a loaded box
POLL_S = 0.2


def _start(command: str, args: list[str]) -> subprocess.Popen:
    """The command in its own session, as a process manager starts it; it dies with this test's process (a pytest
    stopped or killed mid-test leaves no job behind, as `asyncrl run` leaves none)."""
    return subprocess.Popen([sys.executable, "-m", "launch.cli", command, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=launched_environment())


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


def _engine_cores_below(pid: int) -> list[int]:
    return [child for child in alive(descendants(pid)) if "VLLM::EngineCore" in " ".join(_cmdline(psutil.Process(child)))]


def _gone(tree: set[int]) -> set[int]:
    """What of `tree` is still alive once it has had STOP_BOUND_S to go."""
    holds_within(lambda: not alive(tree), STOP_BOUND_S, POLL_S)
    return alive(tree)


@pytest.fixture(scope="module")
def job_dir(tiny_job_inputs) -> Path:
    return tiny_job_inputs  # the shared task files and model; this module's run names are its own


def _kill_and_restart_learner(learner: subprocess.Popen, args: list[str], run_dir: Path,
                              rollout: subprocess.Popen) -> subprocess.Popen:
    """`kill -9` of `asyncrl learner` mid-training, then the same command again, resuming; returns the new one
    once it has logged a step of its own, having checked that the servers kept their processes (and engines)."""
    metrics = run_dir / "metrics.jsonl"
    servers = {server.pid for server in _wait_for(lambda: _servers(rollout), "the rollout's server", learner, rollout)}
    addresses = json.loads((run_dir / "endpoints.json").read_text())
    # only the servers of `rollout` serve the learner: every step it logs from now on is theirs
    _wait_for(lambda: _steps(metrics) and _steps(metrics)[-1] >= KILL_AFTER_STEP, f"step {KILL_AFTER_STEP}", learner,
              rollout)
    tree = descendants(learner.pid)
    learner.kill()
    learner.communicate()
    assert not _gone(tree), f"left behind by the killed learner: {alive(tree)}"
    logged = len(_steps(metrics))
    restarted = _start("learner", [*args, "learner.resume=auto"])
    _wait_for(lambda: len(_steps(metrics)) > logged, "a step of the restarted learner", restarted, rollout)
    assert json.loads((run_dir / "endpoints.json").read_text()) == addresses
    assert {server.pid for server in _servers(rollout)} == servers  # no server restarted its engine
    resumed_at = _steps(metrics)[logged] - 1  # the first step after the checkpoint it resumed from
    assert resumed_at % CHECKPOINT_EVERY == 0 and 0 < resumed_at <= KILL_AFTER_STEP + CHECKPOINT_EVERY, _steps(metrics)
    return restarted


def _steps(metrics: Path) -> list[int]:
    """The step of each whole record of the run's metrics file, in order ([] before the first)."""
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().split("\n")[:-1]]  # the last: "" or being written


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


def two_commands_job(inputs: Path, tmp: Path) -> None:
    """The two commands' whole story on the shared task files and model, in a run directory under `tmp`; each
    check is made when its moment comes (a process is started, signalled or restarted on what the last one saw),
    so a failed one raises here and fails the test that reads this job."""
    job = tiny_job(inputs, TOTAL_STEPS, f"run.root_dir={tmp / 'runs'}", "run.name=two",
                   f"learner.checkpoint_every={CHECKPOINT_EVERY}")
    # the learner's first server comes after two engine starts (the stopped server's, then the second rollout's):
    # it waits for it through both however slow the box, rather than going on alone after the default 300 s
    learner_only = [f"validation.every={VALIDATE_EVERY}", "validation.n=2", "validation.k=2",
                    f"rollout.connect_timeout_s={2 * WAIT_BOUND_S}"]
    rollout_args = [arg for arg in job if not arg.startswith("learner.total_steps=")]
    run_dir, started = tmp / "runs" / "two", []
    try:
        learner = _start("learner", [*job, *learner_only])
        started.append(learner)
        # the stopped server finishes its engine start before it stops, however long that takes on a loaded box,
        # rather than being killed at the default grace of 30 s
        rollout = _start("rollout", [*rollout_args, f"rollout.stop_timeout_s={WAIT_BOUND_S}"])
        started.append(rollout)
        metrics = run_dir / "metrics.jsonl"
        first = _wait_for(lambda: _servers(rollout), "rollout server", learner, rollout)[0]
        engine = _wait_for(lambda: _engine_cores_below(first.pid), "the first server's engine core", learner, rollout)[0]
        # held before its handshake with the server, which comes before vLLM loads our plugin in it: only the
        # parent-death signal it asked for at its very start can end it now
        os.kill(engine, signal.SIGSTOP)
        first.kill()  # a crash, while its engine starts: the supervisor restarts it after its back-off
        assert not _gone({engine}), "the killed server's engine core outlived it"
        restarted = _wait_for(lambda: [s for s in _servers(rollout) if s.pid != first.pid], "restarted server", rollout)
        _wait_for(lambda: _engine_cores_below(restarted[0].pid), "the restarted server's engine core", rollout)
        tree = descendants(rollout.pid)
        rollout.send_signal(signal.SIGINT)  # to it alone, as a process manager would
        _, stderr = rollout.communicate(timeout=WAIT_BOUND_S + STOP_BOUND_S)
        assert rollout.returncode == 130, stderr[-3000:]
        assert not _gone(tree), f"left behind by the stopped rollout: {alive(tree)}"
        assert "server-0 stopped" in (run_dir / "logs" / "rollout0.log").read_text()  # once its engine was up
        # ... and never served: no server joined the learner, which trained nothing
        assert "joined weight sync" not in (run_dir / "logs" / "learner0.log").read_text()
        assert _steps(metrics) == []

        rollout = _start("rollout", rollout_args)  # the learner waits for servers before its first step
        started.append(rollout)
        learner = _kill_and_restart_learner(learner, [*job, *learner_only], run_dir, rollout)
        started.append(learner)
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


REAL_JOBS = [two_commands_job]  # run side by side with other modules' jobs (conftest.py)


def test_two_commands_restart_stop_and_end_together(real_jobs):
    real_jobs[two_commands_job].result()  # raises the job's first failed check
