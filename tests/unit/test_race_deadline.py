"""scripts/race_deadline.py: a run's pace over its steps 4-12 predicts when the race's call ends (the rest of the run,
each later run at its mode's pace, the scoring); a prediction past the deadline stops the run's process. Then
bench_time_to_score.py's flow under --deadline: a stopped race, or one out of reach from the start, gives way to a pace
and the call's own exit status; the options' refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import race_deadline
from scripts.bench_time_to_score import parse_args
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


def test_a_race_past_its_deadline_gives_way_to_a_pace_and_ends_with_its_own_status(tmp_path, monkeypatch, capsys):
    from scripts import bench_time_to_score

    ran = []

    def run_job(mode, seed, args, steps, val_every, root, start_weights, later=None):
        ran.append((mode.name, steps, None if later is None else [(run.mode, run.steps) for run in later]))
        if later is not None:  # the race's watched run: stopped for the deadline
            raise DeadlinePassed("sync made 9.00 s a step over steps 4-12: the call would end 700 s past its deadline")

    monkeypatch.setattr(bench_time_to_score, "run_job", run_job)
    monkeypatch.setattr(bench_time_to_score, "evaluate", lambda *args, **kwargs: pytest.fail("a pace is not scored"))
    monkeypatch.setattr(sys, "argv", ["bench_time_to_score.py", "--modes", "sync,async", "--skip-prepare", "--steps",
                                      "100", "--deadline", "1e10", "--pace-steps", "15", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as ended:
        bench_time_to_score.main()
    assert ended.value.code == bench_time_to_score.PACED_EXIT
    # the race's first run watched with what was to follow it, then the pace: sync 15 steps, async twice as many
    assert ran == [("sync", 100, [("async", 100)]), ("sync", 15, None), ("async", 30, None)]
    assert "deadline: sync made 9.00 s a step" in capsys.readouterr().out


@pytest.mark.parametrize("deadline_in_s, ran_race", [(600.0, False), (1e6, True)])
def test_a_race_out_of_reach_at_the_fastest_pace_on_record_is_not_started(tmp_path, monkeypatch, capsys,
                                                                           deadline_in_s, ran_race):
    from scripts import bench_time_to_score

    ran = []

    def run_job(mode, seed, args, steps, val_every, root, start_weights, later=None):
        ran.append((mode.name, steps))

    monkeypatch.setattr(bench_time_to_score, "run_job", run_job)
    monkeypatch.setattr(bench_time_to_score, "evaluate", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench_time_to_score, "report", lambda *args: None)
    # 100 steps a mode at 5 s a sync step at best: ~1,200 s with the launches and the scoring
    monkeypatch.setattr(sys, "argv", ["bench_time_to_score.py", "--modes", "sync,async", "--skip-prepare", "--steps",
                                      "100", "--deadline", str(time.time() + deadline_in_s), "--fastest-step-s", "5",
                                      "--pace-steps", "15", "--no-evaluate", "--out-dir", str(tmp_path)])
    if ran_race:
        bench_time_to_score.main()
        assert ran == [("sync", 100), ("async", 100)]
        return
    with pytest.raises(SystemExit) as ended:
        bench_time_to_score.main()
    assert ended.value.code == bench_time_to_score.PACED_EXIT
    assert ran == [("sync", 15), ("async", 30)]  # the pace at once, no race step spent
    assert "the race would end" in capsys.readouterr().out


def test_a_fastest_pace_needs_a_deadline(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--fastest-step-s", "5"])
    assert "--fastest-step-s 5: give a pace (seconds, above 0) with a --deadline" in capsys.readouterr().err


def test_a_deadline_is_refused_beside_side_by_side(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--side-by-side", "--deadline", "1e10"])
    assert "--deadline watches one run at a time: it does not go with --side-by-side" in capsys.readouterr().err
