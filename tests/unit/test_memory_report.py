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
    (tmp_path / "config.yaml").write_text("run:\n  gpu_memory_gib: 80.0\n")
    records = [{"step": 1, "memory/peak_gib": 40.5, "memory/peak_reserved_gib": 43.0},
               {"step": 2, "memory/peak_gib": 41.25, "memory/peak_reserved_gib": 42.0}, {"step": 3}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(record) for record in records) + "\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "memory_report.py"), str(tmp_path)],
                          capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[:2] == [PLAN, "10:00:09 [learner0] INFO learner.policy.policy_trainer: micro-batches of 39936 tokens, packed"]
    assert json.loads(lines[-1].removeprefix("RESULT ")) == {"steps": 2, "peak_gib": 41.25, "peak_reserved_gib": 43.0,
                                                             "gpu_memory_gib": 80.0}
