"""The memory report of a finished run (scripts/memory_report.py): the plan lines its roles logged and the learner's
largest peaks over its steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAN = ("10:00:01 [learner0] INFO asyncrl.memory_plan: GPU memory plan: budget 80.0 GiB of the card's 139.8 GiB "
        "(run.gpu_memory_gib=80): ...")


def test_the_report_gives_the_plan_and_the_largest_peaks(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "learner0.log").write_text(
        f"10:00:00 [learner0] INFO learner.main: loading\n{PLAN}\n"
        "10:00:09 [learner0] INFO learner.policy.policy_trainer: micro-batches of 39936 tokens, packed\n")
    (tmp_path / "config.yaml").write_text("run:\n  gpu_memory_gib: 80.0\nmodel:\n  lora:\n    enabled: true\n    rank: 16\n")
    records = [{"step": 1, "time": 100.0, "batch/tokens": 999, "memory/peak_gib": 40.5, "memory/peak_reserved_gib": 43.0},
               {"step": 2, "time": 110.0, "batch/tokens": 3000, "memory/peak_gib": 41.25, "memory/peak_reserved_gib": 42.0,
                "weight_sync/server_pause_seconds": 0.030},
               {"step": 3, "time": 120.0, "batch/tokens": 5000, "weight_sync/server_pause_seconds": 0.010},
               {"step": 4, "time": 120.5, "weight_sync/server_pause_seconds": 0.012}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(record) for record in records) + "\n")
    (tmp_path / "used.csv").write_text("1024\n75257\n2048\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "memory_report.py"), str(tmp_path), "--gpu-used",
                           str(tmp_path / "used.csv"), "--shape", "7b", "--gpus", "1"],
                          capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[:2] == [PLAN, "10:00:09 [learner0] INFO learner.policy.policy_trainer: micro-batches of 39936 tokens, packed"]
    assert json.loads(lines[-1].removeprefix("RESULT ")) == {
        "shape": "7b", "gpus": 1, "steps": 2, "peak_gib": 41.25, "peak_reserved_gib": 43.0, "memory_budget_gib": 80.0,
        # the job's own: nvidia-smi's most, every process on the GPU, less its first reading, taken before the job
        "peak_gpu_memory_gib": round((75257 - 1024) / 1024, 2), "gpu_memory_before_gib": 1.0,
        "gpu_most_used_gib": round(75257 / 1024, 2),
        "trained_tokens_per_s": 400.0,  # 3000 + 5000 tokens after the first step, 20 s from its record to the last's
        "sync_pause_ms": 12.0, "lora_rank": 16, "lora_sync_ms": 12.0}  # the median of 30, 10 and 12 ms


def test_without_lora_or_a_gpu_log_those_figures_are_null(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "config.yaml").write_text("run:\n  gpu_memory_gib: 0.0\nmodel:\n  lora:\n    enabled: false\n    rank: 16\n")
    records = [{"step": 1, "time": 5.0, "batch/tokens": 10, "weight_sync/server_pause_seconds": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(record) for record in records) + "\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "memory_report.py"), str(tmp_path)],
                          capture_output=True, text=True, check=True)
    figures = json.loads(done.stdout.splitlines()[-1].removeprefix("RESULT "))
    assert figures["sync_pause_ms"] == 200.0
    assert (figures["lora_sync_ms"], figures["lora_rank"], figures["peak_gpu_memory_gib"], figures["gpu_most_used_gib"],
            figures["trained_tokens_per_s"],
            figures["shape"], figures["peak_gib"]) == (None, None, None, None, None, None, None)
