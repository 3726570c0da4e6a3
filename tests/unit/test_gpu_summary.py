"""The GPU benchmarks' summary: one RESULT line with every stage's figures, the scale-out ones included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def result_line(figures: dict) -> str:
    return "RESULT " + json.dumps(figures)


def test_the_summary_names_each_scale_out_figure_and_reads_every_result_line_of_a_stage(tmp_path):
    (tmp_path / "big.log").write_text("\n".join([
        "engine started", result_line({"weight_sync_ms": 781.7, "broadcast_ms_by_servers": {"1": 900.0}}),
        result_line({"async_samples_per_s": 32.54, "server_pause_ms": 190.0})]))
    (tmp_path / "broadcast.log").write_text(result_line({"broadcast_ms_by_servers": {"1": 44.0, "2": 48.8}}))
    (tmp_path / "scaling.log").write_text(result_line({"gpus": {"1s1l": 2, "3s1l": 4},
                                                       "scaling_vs_2gpu": {"1s1l": 1.0, "3s1l": 1.353},
                                                       "async_vs_sync": {"1s1l": 1.71, "3s1l": 2.744}}))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, check=True)

    combined = json.loads(done.stdout.splitlines()[-1].removeprefix("RESULT "))
    assert combined["weight_sync_7b_ms"] == 781.7, "the 7B stage's first RESULT line (its weight sync)"
    assert combined["broadcast_ms_by_servers"] == {"1": 44.0, "2": 48.8}
    assert combined["scaling_vs_2gpu"] == {"1s1l": 1.0, "3s1l": 1.353}
    assert combined["async_vs_sync"] == {"1s1l": 1.71, "3s1l": 2.744} and combined["gpus"] == {"1s1l": 2, "3s1l": 4}
    assert combined["ray_vs_plain"] is None and combined["mfu"] is None, "stages that did not run"
    assert "scaling_vs_2gpu          1s1l:1 3s1l:1.35" in done.stdout
