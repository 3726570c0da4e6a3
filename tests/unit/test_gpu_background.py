"""scripts/gpu_background.sh: GPU stages longer than one command on a lent host, started in a session of their own and
followed by later commands. A stand-in for gpu_bench.sh logs, writes into its OUT, and runs until told to end (or,
in the stop test, holds a grandchild until it is stopped)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from processes import alive
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_background.sh"
WAIT_S = 30.0  # for a few shells to start or end on a loaded box
STAND_IN = """#!/usr/bin/env bash
echo "stage $*"
echo "$RACE_ARGS" > "$OUT/race.log"
if [ -n "${HOLD:-}" ]; then sleep 600 & echo $! > "$PIDS/grandchild"; fi
echo $$ > "$PIDS/child"
while [ ! -f "$PIDS/release" ]; do sleep 0.1; done
echo "stage done"
exit 7
"""


def background(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    stand_in = tmp_path / "bench.sh"
    stand_in.write_text(STAND_IN)
    environment = os.environ | {"GPU_BENCH": str(stand_in), "BACKGROUND_DIR": str(tmp_path / "bg"),
                                "PIDS": str(tmp_path), "OUT": str(tmp_path / "out"), "STOP_GRACE_S": "5"} | env
    return subprocess.run(["bash", str(SCRIPT), *args], env=environment, capture_output=True, text=True,
                          timeout=WAIT_S + 10)


def test_a_started_job_outlives_its_command_and_each_wait_shows_what_is_new(tmp_path):
    started = background(tmp_path, "start", "race", RACE_ARGS="--seeds 0")
    assert started.returncode == 0, started.stderr
    try:
        wait_until(lambda: (tmp_path / "child").is_file(), WAIT_S, "the stand-in's start")
        assert os.getsid(int((tmp_path / "child").read_text())) != os.getsid(0)  # a session the host's end spares
        first = background(tmp_path, "wait", "0")
        assert first.returncode == 3 and "stage race" in first.stdout and "still running" in first.stdout
        assert (tmp_path / "out" / "race.log").read_text() == "--seeds 0\n"  # its environment passed through
        second = background(tmp_path, "start", "race")
        assert second.returncode == 1 and "still runs" in second.stderr  # one job at a time
        (tmp_path / "release").touch()
        last = background(tmp_path, "wait", str(int(WAIT_S)))
        assert last.returncode == 0 and "ended with status 7" in last.stdout
        assert "stage done" in last.stdout and "stage race" not in last.stdout  # only the lines not shown before
        assert (tmp_path / "out" / "background.status").read_text().strip() == "7"
        (tmp_path / "child").unlink()
        assert background(tmp_path, "start", "sweep").returncode == 0  # the next job; the one before kept aside
        assert (tmp_path / "bg.previous" / "out" / "race.log").is_file()
        wait_until(lambda: (tmp_path / "child").is_file(), WAIT_S, "the next job's start")
    finally:
        (tmp_path / "release").touch()


def test_stop_ends_the_job_and_the_processes_it_started(tmp_path):
    assert background(tmp_path, "start", "sweep", HOLD="1").returncode == 0
    try:
        wait_until(lambda: (tmp_path / "grandchild").is_file() and (tmp_path / "child").is_file(), WAIT_S,
                   "the stand-in's start")
        job = [int((tmp_path / name).read_text()) for name in ("child", "grandchild")]
        stopped = background(tmp_path, "stop")
        assert stopped.returncode == 0
        wait_until(lambda: not any(alive(pid) for pid in job), WAIT_S, "the job's processes to end")
        assert background(tmp_path, "wait", "0").returncode == 0  # ended: a wait returns at once
    finally:
        for name in ("child", "grandchild"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
                os.kill(int((tmp_path / name).read_text()), signal.SIGKILL)


def test_a_wait_with_nothing_started_and_bad_usage_are_refused(tmp_path):
    assert background(tmp_path, "wait", "5").returncode == 2
    assert background(tmp_path, "wait", "soon").returncode == 2
    assert background(tmp_path, "start").returncode == 2
    assert background(tmp_path, "restart").returncode == 2
