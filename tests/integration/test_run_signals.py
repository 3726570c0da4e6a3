"""`asyncrl run` stops cleanly on Ctrl-C (SIGINT to its process group, as a terminal sends it) and on
SIGTERM (to it alone, as a process manager sends it): every process it started is gone afterwards and the last
line is the run directory. Killed outright (`kill -9`), it leaves no process behind either: each one it started
dies with its parent (`asyncrl.parent_death`).

SIGINT and `kill -9` arrive mid-training (learner, buffer, rollout supervisor, server, vLLM engine core, reward
workers all up); SIGTERM arrives while the rollout server is still starting its engine, the other moment users stop.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import psutil

from asyncrl.exit_codes import CANNOT_START
from run_helpers import RUN_TIMEOUT_S, alive, asyncrl, descendants, kill_tree, tiny_job
from waiting import exited, holds_within, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STOP_BOUND_S = 90  # run.py gives its children 30 s of grace before SIGKILL; slack for a loaded box
WAIT_BOUND_S = 600  # for the moment the signal is sent (engine start and first step on a loaded box)
LEARNER_START_S = 120  # from `asyncrl run` to the learner's endpoints, which its rollout supervisor waits for
POLL_S = 0.5


def _start_run(inputs: Path, tmp: Path, name: str) -> subprocess.Popen:
    """A run on the shared task files and model in `inputs`, its run directory and console under `tmp`."""
    # Its own session, like a shell's foreground job: killpg reaches exactly what a terminal would. The console
    # goes to a file beside the run, where a failed wait reads why the run ended.
    command = [sys.executable, "-m", "launch.cli", "run",
               *tiny_job(inputs, 50, f"run.root_dir={tmp / 'runs'}", f"run.name={name}")]
    with _console(tmp, name).open("w") as console:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=console, text=True, start_new_session=True)


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


# The three stops are real jobs (conftest.py), run beside the other tests: each makes its checks when its moment
# comes (the signal is sent on what the run showed), so a failed one raises from the job and fails its test.


def _trained_a_step(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def _server_starting(run_dir: Path) -> bool:
    return (run_dir / "logs" / "rollout0.log").is_file()


def _signalled_job(inputs: Path, tmp: Path, name: str, signum: int, ready, what: str, whole_group: bool) -> None:
    """A run sent `signum` once `ready(run_dir)` (`what` names that moment), checked by `_stop_and_check`."""
    run_dir = tmp / "runs" / name
    run = _start_run(inputs, tmp, name)
    try:
        _wait_for(lambda: ready(run_dir), run, what, _console(tmp, name))
        _stop_and_check(run, signum, run_dir, whole_group)
    finally:
        kill_tree(run.pid)


def sigint_job(inputs: Path, tmp: Path) -> None:
    _signalled_job(inputs, tmp, "sigint", signal.SIGINT, _trained_a_step, "first training step", whole_group=True)


def sigterm_job(inputs: Path, tmp: Path) -> None:
    _signalled_job(inputs, tmp, "sigterm", signal.SIGTERM, _server_starting, "rollout server start", whole_group=False)


def sigkill_job(inputs: Path, tmp: Path) -> None:
    run_dir = tmp / "runs" / "sigkill"
    run = _start_run(inputs, tmp, "sigkill")
    tree: set[int] = set()
    try:
        _wait_for(lambda: _trained_a_step(run_dir), run, "first training step", _console(tmp, "sigkill"))
        tree = descendants(run.pid)
        names = _described(tree)
        # the ends of the chains: the learner's buffer (its one rank trains in `asyncrl learner` itself); the
        # server's engine core; spawned processes: the server and its reward workers; the rollout supervisor's
        # resource tracker (multiprocessing's, without a parent-death signal: it ends when the last process holding
        # its pipe, the spawned ones below the supervisor, has gone)
        assert any("launch.cli buffer" in name for name in names), names
        assert any("VLLM::EngineCore" in name for name in names), names
        assert sum("multiprocessing.spawn" in name for name in names) >= 3, names
        assert sum("multiprocessing.resource_tracker" in name for name in names) >= 1, names
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
    run = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_BOUND_S)
    return run, malformed, tmp / "runs" / "cannot-start"


def engine_refused_job(inputs: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, Path, float]:
    """A run of a model that vLLM's CPU attention cannot run (head_dim 16: 64 wide, 4 heads), with the default restart
    settings (rollout.max_restarts 10); returns the finished run, its run dir and its wall time in seconds."""
    model = [f"model.path={tmp / 'model'}", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
             "model.warm_start.steps=0"]  # a random model: its engine never samples
    built = asyncrl("init-model", *tiny_job(inputs, 50, *model))
    assert built.returncode == 0, built.stderr[-3000:]
    command = [sys.executable, "-m", "launch.cli", "run", *tiny_job(
        inputs, 50, f"run.root_dir={tmp / 'runs'}", "run.name=cannot-run", *model)]
    started = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return run, tmp / "runs" / "cannot-run", time.monotonic() - started


# run side by side with other modules' jobs (conftest.py)
REAL_JOBS = [malformed_data_job, engine_refused_job, sigint_job, sigterm_job, sigkill_job]


def test_ctrl_c_mid_training_stops_every_process(real_jobs):
    real_jobs[sigint_job].result()  # raises the job's first failed check


def test_sigterm_during_engine_start_stops_every_process(real_jobs):
    real_jobs[sigterm_job].result()  # raises the job's first failed check


def test_kill_9_mid_training_leaves_no_process_behind(real_jobs):
    real_jobs[sigkill_job].result()  # raises the job's first failed check


def test_a_server_that_cannot_start_ends_the_run_with_the_reason_on_the_console(real_jobs):
    # A wrong input (here a data file whose row has no prompt) fails the same way every time: the server is
    # not restarted with back-off while the learner waits, the run ends and the console says why.
    run, malformed, run_dir = real_jobs[malformed_data_job].result()
    assert run.returncode == CANNOT_START, run.stderr[-3000:]
    assert "DataError: malformed rows" in run.stderr and f"{malformed}, row 0:" in run.stderr  # the row, on the console
    assert "stopped by a signal: the ranks closed their services" in run.stderr  # the learner unwound in order
    assert "leaked" not in run.stderr
    assert "cannot start from this config or install (not restarted)" in run.stderr
    supervisor_log = (run_dir / "logs" / "rollout.log").read_text()
    assert "restart" not in supervisor_log.replace("not restarted", "")
    assert run.stdout.strip().splitlines()[-1] == f"RUN_DIR {run_dir}"


def test_an_engine_that_cannot_run_the_model_ends_the_run_at_its_second_death_with_its_error(real_jobs):
    # Built fine, but its vLLM engine refuses the model at the first generate of every start (CPU attention has no
    # kernel for head_dim 16; on a GPU, e.g. no memory for the KV cache). The reason is in the engine core's
    # traceback only; the server hears that its engine died. Restarted once, it dies of the same error, and the run
    # ends with that error on the console instead of nine more restarts with back-off (about 25 minutes here).
    run, run_dir, seconds = real_jobs[engine_refused_job].result()
    assert run.returncode == CANNOT_START, run.stderr[-3000:]
    assert ("server-0 cannot run this config or install (not restarted again): the same error ended 2 starts in a "
            "row, each within rollout.healthy_after_s=300s: RuntimeError: Unsupported CPU attention configuration: "
            "head_dim=16") in run.stderr  # on the console, from the engine core
    supervisor_log = (run_dir / "logs" / "rollout.log").read_text()
    assert supervisor_log.count("restart in") == 1  # one restart, whatever rollout.max_restarts allows
    assert "Unsupported CPU attention configuration: head_dim=16" in (run_dir / "logs" / "rollout0.error").read_text()
    # the run lasted about two server lives (each ~2.5 min on the loaded 2-core box): the learner's start, then the
    # first life, the back-off, the second life and the stop
    first_life_s = float(re.search(r"server-0 exited with code 1 after (\d+)s", supervisor_log).group(1))
    assert seconds < 2 * first_life_s + STOP_BOUND_S + LEARNER_START_S, (seconds, first_life_s)
    assert run.stdout.strip().splitlines()[-1] == f"RUN_DIR {run_dir}"
