"""Commands run side by side, each with an environment and a console log of its own, that end together: as soon as
one fails, the others are stopped (SIGTERM, then SIGKILL after a grace period), so that a benchmark whose pair of runs
has lost one does not spend a GPU host's time on the other."""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

POLL_S = 1.0  # how often the running commands are looked at
STOP_GRACE_S = 60.0  # a stopped command's time to end its own processes before it is killed


@dataclass(frozen=True)
class Job:
    label: str  # names the command in the error that ends the benchmark
    command: Sequence[str]
    env: Mapping[str, str]
    log: Path  # its stdout and stderr: two jobs' live progress lines would garble one console


def run_at_once(jobs: Sequence[Job], timeout_s: float, grace_s: float = STOP_GRACE_S) -> None:
    """Start every job, its output into its log, then wait for all of them; SystemExit naming the first that failed
    (non-zero exit) or the timeout, and the jobs' logs, once every other job has been stopped."""
    with contextlib.ExitStack() as logs:
        running = {job.label: subprocess.Popen(list(job.command), env=dict(job.env), stdout=logs.enter_context(
            open(job.log, "w")), stderr=subprocess.STDOUT) for job in jobs}
        _wait_or_stop(running, timeout_s, grace_s, {job.label: job.log for job in jobs})


def _wait_or_stop(running: dict[str, subprocess.Popen], timeout_s: float, grace_s: float,
                  logs: dict[str, Path]) -> None:
    """Wait for the running jobs; stop them all on a failure, the timeout or an exception here."""
    try:
        failure = _wait_for_all(running, timeout_s)
    except BaseException:  # Ctrl-C or a signal to this process: no job outlives it
        stop_all(running.values(), grace_s)
        raise
    if failure is not None:
        stop_all(running.values(), grace_s)
        raise SystemExit(f"side by side: {failure}; the logs: {', '.join(map(str, logs.values()))}")


def _wait_for_all(running: dict[str, subprocess.Popen], timeout_s: float) -> str | None:
    """Wait until every job has ended, or one failed, or `timeout_s` passed; what went wrong, if anything."""
    deadline = time.monotonic() + timeout_s
    while any(process.poll() is None for process in running.values()):
        if failure := _first_failure(running):
            return failure
        if time.monotonic() > deadline:
            return f"still running after {timeout_s:.0f} s"
        time.sleep(POLL_S)
    return _first_failure(running)


def _first_failure(running: dict[str, subprocess.Popen]) -> str | None:
    for label, process in running.items():
        if process.poll() not in (None, 0):
            return f"{label} exited with {process.returncode}"
    return None


def stop_all(processes: Iterable[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every command still running, SIGKILL to any still running `grace_s` later."""
    alive = [process for process in processes if process.poll() is None]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + grace_s
    for process in alive:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
