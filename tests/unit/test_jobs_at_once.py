"""Commands run side by side end together: all of them finish, or the first failure stops the rest."""

import os
import sys
import time
from pathlib import Path

import pytest

from scripts.jobs_at_once import Job, run_at_once


def python_job(label: str, code: str, **env: str) -> Job:
    return Job(label, [sys.executable, "-c", code], os.environ | env, Path(env.get("LOG", os.devnull)))


def test_every_job_runs_to_its_end_each_with_its_own_environment(tmp_path):
    show = "import os; print('sees', os.environ['CUDA_VISIBLE_DEVICES'])"
    run_at_once([python_job("sync", show, LOG=str(tmp_path / "sync.log"), CUDA_VISIBLE_DEVICES="0"),
                 python_job("async", "import time; time.sleep(1.5); " + show, LOG=str(tmp_path / "async.log"),
                            CUDA_VISIBLE_DEVICES="1")], timeout_s=60)
    assert (tmp_path / "sync.log").read_text() == "sees 0\n" and (tmp_path / "async.log").read_text() == "sees 1\n"


def test_the_first_failure_stops_the_other_job_and_names_itself(tmp_path):
    survivor = tmp_path / "survived"
    started = time.monotonic()
    with pytest.raises(SystemExit, match=f"sync exited with 3; the logs: {tmp_path / 'sync.log'}"):
        run_at_once([python_job("sync", "import time, sys; time.sleep(0.5); sys.exit(3)", LOG=str(tmp_path / "sync.log")),
                     python_job("async", f"import time, pathlib; time.sleep(30); pathlib.Path({str(survivor)!r}).touch()")],
                    timeout_s=60)
    assert time.monotonic() - started < 20 and not survivor.exists()


def test_a_job_that_ignores_the_stop_is_killed_after_the_grace_period(tmp_path):
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    started = time.monotonic()
    with pytest.raises(SystemExit, match="still running after 2 s"):
        run_at_once([python_job("async", stubborn)], timeout_s=2, grace_s=1)
    assert time.monotonic() - started < 15


class Interrupted(BaseException):
    """Stands for Ctrl-C (pytest would take a real KeyboardInterrupt as its own)."""


def test_an_interrupt_of_the_runner_stops_every_job(tmp_path, monkeypatch):
    survivor = tmp_path / "survived"

    def interrupted(running):
        raise Interrupted

    monkeypatch.setattr("scripts.jobs_at_once._first_failure", interrupted)
    started = time.monotonic()
    with pytest.raises(Interrupted):
        run_at_once([python_job("sync", f"import time, pathlib; time.sleep(3); pathlib.Path({str(survivor)!r}).touch()")],
                    timeout_s=60, grace_s=1)
    time.sleep(max(0.0, started + 5 - time.monotonic()))  # past the time the job would have written its file
    assert not survivor.exists()
