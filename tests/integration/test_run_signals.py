"""`asyncrl run` stops cleanly on Ctrl-C (SIGINT to its process group, as a terminal sends it) and on
SIGTERM (to it alone, as a process manager sends it): every process it started is gone afterwards and the last
line is the run directory. Killed outright (`kill -9`), it leaves no process behind either: each one it started
dies with its parent (`asyncrl.parent_death`).

SIGINT and `kill -9` arrive mid-training (learner, buffer, rollout supervisor, server, vLLM engine core, reward
workers all up); SIGTERM arrives while the rollout server is still starting its engine, the other moment users stop.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import psutil

from run_helpers import alive, descendants, kill_tree, tiny_job
from waiting import exited, holds_within, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STOP_BOUND_S = 90  # run.py gives its children 30 s of grace before SIGKILL; slack for a loaded box
WAIT_BOUND_S = 600  # for the moment the signal is sent (engine start and first step on a loaded box)
POLL_S = 0.5


def _start_run(tmp: Path, name: str) -> subprocess.Popen:
    # Its own session, like a shell's foreground job: killpg reaches exactly what a terminal would. The console
    # goes to a file beside the run, where a failed wait reads why the run ended.
    command = [sys.executable, "-m", "launch.cli", "run", *tiny_job(tmp, 50, f"run.name={name}")]
    with _console(tmp, name).open("w") as console:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=console, text=True, start_new_session=True,
                                env=os.environ.copy())


def _console(tmp: Path, name: str) -> Path:
    return tmp / f"{name}.console"


def _wait_for(condition, run: subprocess.Popen, what: str, console: Path) -> None:
    wait_until(condition, WAIT_BOUND_S, what, poll_s=POLL_S, give_up=exited(run),
               context=lambda: console.read_text()[-3000:])


def _stop_and_check(run: subprocess.Popen, signum: int, run_dir: Path, whole_group: bool) -> None:
    tree = descendants(run.pid)
    assert len(tree) >= 3, tree  # learner, rollout supervisor, and what they started
    if whole_group:
        os.killpg(run.pid, signum)
    else:
        run.send_signal(signum)
    stdout, _ = run.communicate(timeout=STOP_BOUND_S)
    assert run.returncode == 130, run.returncode
    assert stdout.strip().splitlines()[-1] == f"RUN_DIR {run_dir}"
    _check_gone(tree)


def _check_gone(tree: set[int]) -> None:
    assert holds_within(lambda: not alive(tree), STOP_BOUND_S, POLL_S), f"left behind: {_described(alive(tree))}"


def _described(pids: set[int]) -> list[str]:
    """Each pid with its command line, for a failure's message."""
    found = []
    for pid in sorted(pids):
        try:
            found.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def job_dir(tiny_job_inputs) -> Path:
    return tiny_job_inputs  # the shared task files and model; this module's run names are its own


def test_ctrl_c_mid_training_stops_every_process(job_dir):
    run_dir = job_dir / "runs" / "sigint"
    run = _start_run(job_dir, "sigint")
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, run, "first training step",
                  _console(job_dir, "sigint"))
        _stop_and_check(run, signal.SIGINT, run_dir, whole_group=True)
    finally:
        kill_tree(run.pid)


def test_sigterm_during_engine_start_stops_every_process(job_dir):
    run_dir = job_dir / "runs" / "sigterm"
    run = _start_run(job_dir, "sigterm")
    try:
        _wait_for(lambda: (run_dir / "logs" / "rollout0.log").is_file(), run, "rollout server start",
                  _console(job_dir, "sigterm"))
        _stop_and_check(run, signal.SIGTERM, run_dir, whole_group=False)
    finally:
        kill_tree(run.pid)


def test_kill_9_mid_training_leaves_no_process_behind(job_dir):
    run_dir = job_dir / "runs" / "sigkill"
    run = _start_run(job_dir, "sigkill")
    tree: set[int] = set()
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, run, "first training step",
                  _console(job_dir, "sigkill"))
        tree = descendants(run.pid)
        names = _described(tree)
        # the ends of the chains: the learner's buffer; the server's engine core; spawned processes: the learner
        # rank, the server and its reward worker(s); the resource trackers of `asyncrl learner` and of the rollout
        # supervisor (multiprocessing's, without a parent-death signal: each ends when the last process holding
        # its pipe, the spawned ones below its starter, has gone)
        assert any("launch.cli buffer" in name for name in names), names
        assert any("VLLM::EngineCore" in name for name in names), names
        assert sum("multiprocessing.spawn" in name for name in names) >= 3, names
        assert sum("multiprocessing.resource_tracker" in name for name in names) >= 2, names
        run.kill()  # nothing of asyncrl's runs now to stop the children: the kernel does, one generation at a time
        run.wait()
        _check_gone(tree)
    finally:
        kill_tree(run.pid)
        for pid in alive(tree):  # orphans of a failed check, adopted by init: not below the run any more
            os.kill(pid, signal.SIGKILL)


def malformed_data_job(inputs: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """A run whose data file has a row without a prompt; returns the finished run, the file and the run dir."""
    malformed = tmp / "malformed.jsonl"
    malformed.write_text('{"question": "2+2"}\n')
    command = [sys.executable, "-m", "launch.cli", "run", *tiny_job(
        inputs, 50, f"run.root_dir={tmp / 'runs'}", "run.name=cannot-start", f"data.train_files=[{malformed}]")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_BOUND_S, env=os.environ.copy())
    return run, malformed, tmp / "runs" / "cannot-start"


def engine_refused_job(inputs: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """A run whose engine refuses its settings at every start (one restart allowed); returns it and its run dir."""
    command = [sys.executable, "-m", "launch.cli", "run", *tiny_job(
        inputs, 50, f"run.root_dir={tmp / 'runs'}", "run.name=keeps-dying", "rollout.engine.max_model_len=100000",
        "rollout.max_restarts=1", "rollout.restart_backoff_s=0.1")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_BOUND_S, env=os.environ.copy())
    return run, tmp / "runs" / "keeps-dying"


REAL_JOBS = [malformed_data_job, engine_refused_job]  # run side by side with other modules' jobs (conftest.py)


def test_a_server_that_cannot_start_ends_the_run_with_the_reason_on_the_console(real_jobs):
    # A wrong input (here a data file whose row has no prompt) fails the same way every time: the server is
    # not restarted with back-off while the learner waits, the run ends and the console says why.
    run, malformed, run_dir = real_jobs[malformed_data_job].result()
    assert run.returncode == 1, run.stderr[-3000:]
    assert "DataError: malformed rows" in run.stderr and f"{malformed}, row 0:" in run.stderr  # the row, on the console
    assert "stopped by a signal: the ranks closed their services" in run.stderr  # the learner unwound in order
    assert "leaked" not in run.stderr
    assert "cannot start from this config or install (not restarted)" in run.stderr
    supervisor_log = (run_dir / "logs" / "rollout.log").read_text()
    assert "restart" not in supervisor_log.replace("not restarted", "")
    assert run.stdout.strip().splitlines()[-1] == f"RUN_DIR {run_dir}"


def test_a_server_that_keeps_dying_at_start_ends_the_run_after_its_restarts(real_jobs):
    # Built fine, but its engine refuses the settings each time it starts (a context longer than the model's
    # positions; on a GPU, e.g. no memory for the KV cache): restarted rollout.max_restarts times, then given up.
    run, run_dir = real_jobs[engine_refused_job].result()
    assert run.returncode == 1, run.stderr[-3000:]
    assert "server-0 keeps dying: death 2 in a row within rollout.healthy_after_s=300s" in run.stderr
    assert "rollout.max_restarts=1" in run.stderr
    supervisor_log = (run_dir / "logs" / "rollout.log").read_text()
    assert supervisor_log.count("restart in 0.1s (death 1 in a row") == 1
    assert run.stdout.strip().splitlines()[-1] == f"RUN_DIR {run_dir}"
