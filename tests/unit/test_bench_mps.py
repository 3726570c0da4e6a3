"""scripts/bench_mps.py: each arm's job gets its own override and directory, and the report of the H100 records
(docs/data/time_to_score/mps-ab-2026-12-06-600m-h100-*.tar.gz) gives the figures worked out from their steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import bench_mps

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "data" / "time_to_score"
RESTORE = [f"{arm}={RECORDS / f'mps-ab-2026-12-06-600m-h100-{arm}.tar.gz'}" for arm in ("turns", "mps")]


def test_each_arm_runs_the_async_job_with_its_override_in_a_directory_of_its_own(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(bench_mps, "run_job", lambda mode, seed, args, steps, val_every, root, weights:
                        ran.append((mode.name, args.overrides[-1], steps, val_every, root.name)))
    args = bench_mps.parse_args(["--steps", "12", "optim.lr=1e-6"])
    for arm in bench_mps.ARMS:
        bench_mps.run_arm(arm, bench_mps.Mode("async", 2), args, tmp_path, None)
    assert ran == [("async", "run.mps=off", 12, 12, "turns"), ("async", "run.mps=on", 12, 12, "mps")]
    assert args.overrides == ["optim.lr=1e-6"]  # the arms' overrides are their own


def test_a_restore_must_name_its_arm_and_an_archive(capsys):
    with pytest.raises(SystemExit):
        bench_mps.parse_args(["--arms", "", "--restore", "fast=/nonexistent.tar.gz"])
    assert "--restore fast=/nonexistent.tar.gz: give ARM=FILE" in capsys.readouterr().err


def test_the_report_of_the_h100_records(tmp_path):
    done = subprocess.run([sys.executable, "scripts/bench_mps.py", "buffer.batch_groups=64", "--arms", "",
                           "--out-dir", str(tmp_path), "--restore", *RESTORE], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1].removeprefix("RESULT "))
    turns, mps = result["turns"], result["mps"]
    # steps 4-16 (after K + 1 = 3): 13 steps of 512 samples, timed from step 3's record to step 16's
    assert turns["trained_tokens_per_s"] == pytest.approx(18021.1, abs=0.1)
    assert mps["trained_tokens_per_s"] == pytest.approx(16680.3, abs=0.1)
    assert result["mps_speedup"] == round(16680.25 / 18021.089, 3) == 0.926
    assert (turns["wait_s"], turns["train_s"], mps["wait_s"], mps["train_s"]) == (2.104, 3.279, 3.086, 2.557)
    assert result["same_start"] is True and turns["steps"] == mps["steps"] == 16
