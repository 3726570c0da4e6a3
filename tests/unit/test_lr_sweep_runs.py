"""The learning-rate sweep's runs (scripts/lr_sweep.py `run_all`): --at-once at a time, and after a failure no run
starts that had not started yet; the failure ends the sweep. The runs are stand-ins that record their rate."""

import argparse
import threading

import pytest

import scripts.lr_sweep
from scripts.lr_sweep import rate_figures, run_all


@pytest.fixture
def started(monkeypatch) -> list[str]:
    rates: list[str] = []
    lock = threading.Lock()

    def run_rate(rate, args, root):
        with lock:
            rates.append(rate)
        if rate == "bad":
            raise SystemExit(f"lr {rate}: asyncrl run exited with 1")

    monkeypatch.setattr(scripts.lr_sweep, "run_rate", run_rate)
    return rates


def test_a_failed_run_starts_no_other_and_ends_the_sweep(started, tmp_path):
    with pytest.raises(SystemExit, match="lr bad"):
        run_all(["bad", "1e-6", "5e-6"], argparse.Namespace(at_once=1), tmp_path)
    assert started == ["bad"]


def test_every_rate_runs_once(started, tmp_path):
    run_all(["1e-6", "2.5e-6", "5e-6"], argparse.Namespace(at_once=0), tmp_path)
    assert sorted(started) == ["1e-6", "2.5e-6", "5e-6"]


def test_a_rate_reads_its_curve_and_says_none_where_its_scores_cannot_tell(tmp_path):
    import json

    from asyncrl.snapshots import EVALUATION_FILE

    def scored(name: str, scores: dict[int, float]):
        directory = tmp_path / name
        directory.mkdir()
        (directory / EVALUATION_FILE).write_text("".join(
            json.dumps({"version": version, "val/score/mean": score}) + "\n" for version, score in scores.items()))
        return rate_figures(directory)

    assert scored("learned", {5: 0.6, 0: 0.4, 10: 0.55}) == {
        "curve": [[0, 0.4], [5, 0.6], [10, 0.55]], "best": 0.6, "final": 0.55, "rise": 0.15}
    assert scored("no-start", {5: 0.6, 10: 0.7})["rise"] is None  # version 0 unscored: no rise to read
    assert scored("unscored", {}) == {"curve": [], "best": None, "final": None, "rise": None}
