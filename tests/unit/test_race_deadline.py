"""scripts/race_deadline.py: a run's pace over its steps 4-12 predicts when the race's call ends (the rest of the run,
each later run at its mode's pace, the scoring); a prediction past the deadline stops the run's process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import race_deadline
from scripts.race_deadline import (ASYNC_STEP_SPEEDUP, RUN_START_S, SCORING_S, DeadlinePassed, LaterRun,
                                   beyond_reach, predicted_end, seconds_a_step, wait_within)


def write_steps(run_dir: Path, seconds: dict[int, float]) -> None:
    """Step records made at the given Unix times, with a validation pass's record of its own among them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": step, "time": made, "timing_s/step": 1.0}) for step, made in seconds.items()]
    lines.insert(1, json.dumps({"step": 4, "time": 9999.0, "val/score/mean": 0.4}))  # no step time: not a step
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_the_pace_is_the_seconds_a_step_from_step_4_to_step_12(tmp_path):
    assert seconds_a_step(tmp_path / "none") is None  # no metrics yet
    write_steps(tmp_path, {step: 100.0 + 8.0 * step for step in range(1, 12)})
    assert seconds_a_step(tmp_path) is None  # step 12 not made yet
    write_steps(tmp_path, {1: 50.0, 4: 100.0, 12: 164.0})
    assert seconds_a_step(tmp_path) == 8.0


def test_the_end_counts_the_rest_of_the_run_each_later_run_at_its_mode_s_pace_and_the_scoring():
    later = [LaterRun("async", 100), LaterRun("sync", 10)]
    expected = 1000.0 + 88 * 7.0 + RUN_START_S + 100 * 7.0 / ASYNC_STEP_SPEEDUP + RUN_START_S + 10 * 7.0 + SCORING_S
    assert predicted_end(1000.0, 7.0, "sync", 88, later) == pytest.approx(expected)
    # an async run watched: a later sync run's steps take longer than its own
    assert predicted_end(0.0, 4.0, "async", 0, [LaterRun("sync", 10)]) == \
        pytest.approx(RUN_START_S + 10 * 4.0 * ASYNC_STEP_SPEEDUP + SCORING_S)


def sleeper(seconds: float, status: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds}); raise SystemExit({status})"])


def test_a_run_whose_pace_overruns_the_deadline_is_stopped_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(race_deadline, "STOP_GRACE_S", 5.0)
    write_steps(tmp_path, {4: 0.0, 12: 80.0})  # 10 s a step: 88 more steps alone take 880 s
    process = sleeper(60)
    began = time.monotonic()
    with pytest.raises(DeadlinePassed, match=r"sync made 10.00 s a step over steps 4-12: the call would end \d+ s past"):
        wait_within(process, tmp_path, "sync", 100, [LaterRun("async", 100)], deadline=time.time() + 900, poll_s=0.1)
    assert process.poll() is not None and time.monotonic() - began < 10  # stopped, not waited for


def test_a_run_that_fits_is_waited_for_and_its_status_returned(tmp_path, capsys):
    write_steps(tmp_path, {4: 0.0, 12: 8.0})  # 1 s a step
    status = wait_within(sleeper(0.5, 3), tmp_path, "sync", 100, [LaterRun("async", 100)],
                         deadline=time.time() + 3600, poll_s=0.1)
    assert status == 3  # a failed run's status still reaches the caller
    assert "deadline: sync at 1.00 s a step; the call ends ~" in capsys.readouterr().out


def test_a_run_that_ends_before_its_pace_is_known_returns_its_status(tmp_path):
    assert wait_within(sleeper(0.2), tmp_path, "async", 100, [], deadline=time.time() + 30, poll_s=0.1) == 0


def test_a_run_still_going_at_the_deadline_is_stopped_though_it_never_made_its_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(race_deadline, "STOP_GRACE_S", 5.0)
    process = sleeper(60)
    with pytest.raises(DeadlinePassed, match="async was still running at its deadline"):
        wait_within(process, tmp_path, "async", 100, [], deadline=time.time() + 0.3, poll_s=0.1)
    assert process.poll() is not None


def test_a_race_beyond_reach_even_at_the_fastest_pace_on_record_is_told_by_how_much():
    later = [LaterRun("async", 100)]
    # at 5 s a sync step: its launch, 100 steps, async's launch and 100 steps at 5 / 1.35 s, then the scoring
    at_best = RUN_START_S + 100 * 5.0 + RUN_START_S + 100 * 5.0 / ASYNC_STEP_SPEEDUP + SCORING_S
    assert beyond_reach(1000.0, 5.0, "sync", 100, later, deadline=1000.0 + at_best - 50) == pytest.approx(50)
    assert beyond_reach(1000.0, 5.0, "sync", 100, later, deadline=1000.0 + at_best + 1) is None
    # an async run first goes at its own pace, relative to sync's fastest
    assert beyond_reach(0.0, 5.0, "async", 100, [], deadline=0.0) == pytest.approx(
        RUN_START_S + 100 * 5.0 / ASYNC_STEP_SPEEDUP + SCORING_S)
