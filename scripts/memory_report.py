"""What a finished run planned for its GPU memory and what it used: the plan lines its roles logged (the budget's
split, vLLM's share and its KV cache, the learner's micro-batches and checkpointing) and the learner's peak memory
per step.

Usage: python scripts/memory_report.py RUN_DIR. Last line: RESULT {json} with steps (records with a peak),
peak_gib and peak_reserved_gib (the largest `memory/peak_gib` and `memory/peak_reserved_gib` over the run's
steps, docs/metrics.md) and gpu_memory_gib (the run's `run.gpu_memory_gib`); the peaks are null on CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

# the log lines that say how the GPU's memory was planned (docs/placement.md and docs/learner.md, "Memory")
PLAN_MARKS = ("GPU memory plan", "run.gpu_memory_gib=", "learner.micro_batch_tokens=auto",
              "learner.activation_checkpointing=auto", "micro-batches of", "Available KV cache memory")


def plan_lines(run_dir: Path) -> list[str]:
    """Every log line of the run's roles that says how the memory was planned, file by file."""
    return [line for path in sorted((run_dir / "logs").glob("*")) if path.is_file()
            for line in path.read_text(errors="replace").splitlines() if any(mark in line for mark in PLAN_MARKS)]


def memory_figures(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    peaks = [record for record in records if record.get("memory/peak_gib") is not None]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return {
        "steps": len(peaks),
        "peak_gib": max((record["memory/peak_gib"] for record in peaks), default=None),
        "peak_reserved_gib": max((record["memory/peak_reserved_gib"] for record in peaks), default=None),
        "gpu_memory_gib": config["run"]["gpu_memory_gib"],
    }


def main() -> None:
    run_dir = Path(sys.argv[1])
    for line in plan_lines(run_dir):
        print(line)
    print("RESULT " + json.dumps(memory_figures(run_dir)), flush=True)


if __name__ == "__main__":
    main()
