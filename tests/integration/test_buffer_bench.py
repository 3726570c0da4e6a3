"""scripts/bench_buffer.py measures every phase against a real buffer, ends with its RESULT line, and
removes its temporary logs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BENCH_TIMEOUT_S = 180
GROUPS, SAMPLES, REPEATS = 40, 2, 2


def test_bench_reports_ingest_against_raw_zeromq(tmp_path):
    environment = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_buffer.py"), "--groups", str(GROUPS),
                           "--samples-per-group", str(SAMPLES), "--window", "4", "--repeats", str(REPEATS)],
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, cwd=ROOT, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last.removeprefix("RESULT "))
    for key in ("ingest_traj_per_s", "ack_p99_ms", "raw_zmq_traj_per_s", "raw_zmq_lists_traj_per_s",
                "delivery_traj_per_s"):
        assert result[key] > 0, key
    assert result["ack_p50_ms"] <= result["ack_p99_ms"]
    assert result["repeats"] == REPEATS
    rounds = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rounds) == REPEATS, done.stdout
    ratios = sorted(float(fields[3]) for fields in rounds)  # round, raw traj/s, ingest traj/s, ratio, ...
    for fields in rounds:
        assert float(fields[3]) == pytest.approx(float(fields[2]) / float(fields[1]), abs=0.01)
    assert result["ingest_vs_raw_min"] == pytest.approx(ratios[0], abs=0.01)
    assert result["ingest_vs_raw_max"] == pytest.approx(ratios[-1], abs=0.01)
    assert result["ingest_vs_raw"] == pytest.approx(sum(ratios) / REPEATS, abs=0.01)  # median of two
    if result["buffer_cpu_us_per_traj"] is not None:  # None when the phase was shorter than a CPU clock tick
        assert result["buffer_one_core_traj_per_s"] == pytest.approx(1e6 / result["buffer_cpu_us_per_traj"], rel=0.01)
    assert not list(tmp_path.glob("bench_buffer_*")), "the benchmark left its logs behind"
