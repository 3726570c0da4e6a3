"""The learning-rate sweep's runs (scripts/lr_sweep.py `run_all`): --at-once at a time, and after a failure no run
starts that had not started yet; the failure ends the sweep. The runs are stand-ins that record their rate."""

import argparse
import threading

import pytest

import scripts.lr_sweep
from scripts.lr_sweep import run_all


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
