"""The race's deadline (bench_time_to_score.py --deadline): a lent GPU host goes back at a set time, and a race that
cannot end by then spends the session on runs that will never be scored. Once a run has made its PACE_STEPS, its
seconds a step predict when this call's runs and their scoring end; a prediction past the deadline stops the run, so
that what time is left goes to a shorter pass (the caller's). A race that could not end in time even at its task's
fastest pace on record is not started at all (`beyond_reach`)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from asyncrl.metrics import METRICS_FILE, read_metrics, step_records
from scripts.jobs_at_once import STOP_GRACE_S, stop_all

PACE_STEPS = (4, 12)  # a run's seconds a step from its step 4 to its step 12: its first steps hold compiles and a backlog
# An async run's steps against sync's at the race's ~600 M shape on one H100 (1.36x to 1.55x over three hosts,
# docs/benchmarks.md): the lower end, so that the prediction errs towards stopping.
ASYNC_STEP_SPEEDUP = 1.35
RUN_START_S = 70.0  # a later run's launch to its first step from warm compile caches (66 s measured on one H100)
SCORING_S = 150.0  # scoring the race's snapshots after its runs (138 s: 12 snapshots of ~600 M on four engines)
POLL_S = 5.0  # how often the running job's metrics are read


class DeadlinePassed(Exception):
    """The watched run was stopped: the call would have ended past its deadline."""


@dataclass(frozen=True)
class LaterRun:
    mode: str  # "sync" or "async"
    steps: int


def seconds_a_step(run_dir: Path) -> float | None:
    """The run's wall seconds a step over PACE_STEPS, from its step records' times; None until it has made them."""
    if not (run_dir / METRICS_FILE).is_file():
        return None
    made = {record["step"]: record["time"] for record in step_records(read_metrics(run_dir))}
    first, last = PACE_STEPS
    if first not in made or last not in made:
        return None
    return (made[last] - made[first]) / (last - first)


def predicted_end(now: float, pace: float, mode: str, steps_left: int, later: Sequence[LaterRun]) -> float:
    """When this call's work ends: the watched `mode` run's `steps_left` at `pace`, each later run's start and steps
    at its mode's pace relative to this one's (ASYNC_STEP_SPEEDUP), then the snapshots' scoring."""
    seconds = steps_left * pace
    for run in later:
        seconds += RUN_START_S + run.steps * pace * _relative_step_seconds(mode, run.mode)
    return now + seconds + SCORING_S


def beyond_reach(now: float, fastest_step_s: float, mode: str, steps: int, later: Sequence[LaterRun],
                 deadline: float) -> float | None:
    """How far past `deadline` the call would end if its first run (of `mode`, not yet launched) and each later one ran
    at the task's fastest pace on record (`fastest_step_s`, a synchronous step; async's relative to it); None where
    it could end in time. Such a race is not started: it would spend the session's first minutes only to be stopped."""
    pace = fastest_step_s * _relative_step_seconds("sync", mode)
    end = predicted_end(now + RUN_START_S, pace, mode, steps, later)
    return end - deadline if end > deadline else None


def _relative_step_seconds(watched: str, later: str) -> float:
    if watched == later:
        return 1.0
    return 1 / ASYNC_STEP_SPEEDUP if later == "async" else ASYNC_STEP_SPEEDUP


def wait_within(process: subprocess.Popen, run_dir: Path, mode: str, steps: int, later: Sequence[LaterRun],
                deadline: float, clock: Callable[[], float] = time.time, poll_s: float = POLL_S) -> int:
    """Wait for the run's `process` and return its exit status. Once its pace is known and puts the call's end past
    `deadline` (Unix seconds), or the deadline itself passes while it runs (a run that never makes its steps), stop
    it (SIGTERM, SIGKILL after STOP_GRACE_S) and raise DeadlinePassed."""
    judged = False
    while process.poll() is None:
        if clock() > deadline:
            stop_all([process], STOP_GRACE_S)
            raise DeadlinePassed(f"{mode} was still running at its deadline")
        pace = None if judged else seconds_a_step(run_dir)
        if pace is not None:
            end = predicted_end(clock(), pace, mode, steps - PACE_STEPS[1], later)
            if end > deadline:
                stop_all([process], STOP_GRACE_S)
                raise DeadlinePassed(f"{mode} made {pace:.2f} s a step over steps {PACE_STEPS[0]}-{PACE_STEPS[1]}: "
                                     f"the call would end {end - deadline:.0f} s past its deadline")
            print(f"deadline: {mode} at {pace:.2f} s a step; the call ends ~{deadline - end:.0f} s before its "
                  "deadline", flush=True)
            judged = True
        time.sleep(poll_s)
    return process.returncode

