"""What a finished run planned for its GPU memory and what it used: the plan lines its roles logged (the budget's
split, vLLM's share and its KV cache, the learner's micro-batches and checkpointing), the learner's peak memory per
step, the whole GPU's most as the driver saw it, and the job's pace and weight-sync pauses.

Usage: python scripts/memory_report.py RUN_DIR [--gpu-used FILE] [--shape NAME] [--gpus N]. Last line:
RESULT {json} with
- steps (records with a peak), peak_gib and peak_reserved_gib (the largest `memory/peak_gib` and
  `memory/peak_reserved_gib` over the run's steps, docs/metrics.md; null on CPU);
- memory_budget_gib (the run's `run.gpu_memory_gib`, 0: the whole card);
- from FILE, memory used on the GPU in MiB one reading a line (nvidia-smi's `--query-gpu=memory.used
  --format=csv,noheader,nounits`, every process on it, its first reading taken before the job started):
  gpu_most_used_gib, the most; gpu_memory_before_gib, the first (what others held); peak_gpu_memory_gib, the most
  less the first: the job's own peak, every process of it (true where the others' use stayed as it was); null
  without FILE;
- trained_tokens_per_s: `batch/tokens` of every step after the first over the wall-clock time from the first step's
  record to the last's;
- sync_pause_ms: the median over the run's weight-sync rounds of `weight_sync/server_pause_seconds` (the longest
  pause-to-resume a server reported in the round), in ms; lora_sync_ms is the same figure when the policy is
  served as a LoRA adapter (`model.lora.enabled`), with lora_rank, else both are null;
- shape and gpus, as given (what the job ran on; not in the run's files).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import yaml

# the log lines that say how the GPU's memory was planned (docs/placement.md and docs/learner.md, "Memory")
PLAN_MARKS = ("GPU memory plan", "run.gpu_memory_gib=", "learner.micro_batch_tokens=auto",
              "learner.activation_checkpointing=auto", "micro-batches of", "Available KV cache memory")
PAUSE_KEY = "weight_sync/server_pause_seconds"
MIB_PER_GIB = 1024


def plan_lines(run_dir: Path) -> list[str]:
    """Every log line of the run's roles that says how the memory was planned, file by file."""
    return [line for path in sorted((run_dir / "logs").glob("*")) if path.is_file()
            for line in path.read_text(errors="replace").splitlines() if any(mark in line for mark in PLAN_MARKS)]


def gpu_memory_figures(gpu_used: Path | None) -> dict[str, float | None]:
    """From an nvidia-smi memory.used log (MiB a line, the first before the job started), in GiB: the job's peak (the
    most less the first), the first, and the most."""
    readings = [float(line) for line in gpu_used.read_text().split()] if gpu_used is not None else []
    if not readings:
        return {"peak_gpu_memory_gib": None, "gpu_memory_before_gib": None, "gpu_most_used_gib": None}
    return {"peak_gpu_memory_gib": round((max(readings) - readings[0]) / MIB_PER_GIB, 2),
            "gpu_memory_before_gib": round(readings[0] / MIB_PER_GIB, 2),
            "gpu_most_used_gib": round(max(readings) / MIB_PER_GIB, 2)}


def trained_tokens_per_s(records: list[dict[str, Any]]) -> float | None:
    """Tokens trained after the first step over the time from its record to the last step's: the job's pace with
    its start (engine and learner loading, the first batch) left out."""
    steps = [record for record in records if "batch/tokens" in record and "time" in record]
    if len(steps) < 2 or steps[-1]["time"] <= steps[0]["time"]:
        return None
    return round(sum(record["batch/tokens"] for record in steps[1:]) / (steps[-1]["time"] - steps[0]["time"]), 1)


def median_pause_ms(records: list[dict[str, Any]]) -> float | None:
    pauses = [record[PAUSE_KEY] for record in records if record.get(PAUSE_KEY) is not None]
    return round(statistics.median(pauses) * 1000, 2) if pauses else None


def run_figures(run_dir: Path, gpu_used: Path | None = None, shape: str = "", gpus: int | None = None) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    peaks = [record for record in records if record.get("memory/peak_gib") is not None]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    lora = config.get("model", {}).get("lora", {})
    pause_ms = median_pause_ms(records)
    return {
        "shape": shape or None,
        "gpus": gpus,
        "steps": len(peaks),
        "peak_gib": max((record["memory/peak_gib"] for record in peaks), default=None),
        "peak_reserved_gib": max((record["memory/peak_reserved_gib"] for record in peaks), default=None),
        "memory_budget_gib": config["run"]["gpu_memory_gib"],
        **gpu_memory_figures(gpu_used),
        "trained_tokens_per_s": trained_tokens_per_s(records),
        "sync_pause_ms": pause_ms,
        "lora_rank": lora.get("rank") if lora.get("enabled") else None,
        "lora_sync_ms": pause_ms if lora.get("enabled") else None,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the finished run's directory (runs/<name>)")
    parser.add_argument("--gpu-used", type=Path, default=None,
                        help="nvidia-smi's memory.used readings of the job's GPU, MiB a line")
    parser.add_argument("--shape", default="", help="the model's shape, as the RESULT should name it (e.g. 7b)")
    parser.add_argument("--gpus", type=int, default=None, help="the GPUs the job ran on")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    for line in plan_lines(args.run_dir):
        print(line)
    print("RESULT " + json.dumps(run_figures(args.run_dir, args.gpu_used, args.shape, args.gpus)), flush=True)


if __name__ == "__main__":
    main()
