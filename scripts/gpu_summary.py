"""Combine the RESULT lines of scripts/gpu_bench.sh's stage logs into one table and one RESULT line.

Usage: python scripts/gpu_summary.py OUT_DIR. Stages that did not run (or failed) show as missing; a stage
that printed several RESULT lines (the 7B stage: its weight sync, then its job) gives the figures of all of them.
Last line: RESULT {json} with rollout_vs_vllm_ratio, weight_sync_ms, nccl_floor_ms,
async_vs_sync_speedup and mfu, the scale-out figures gpus, scaling_vs_2gpu, async_vs_sync (per layout),
ray_vs_plain, weight_sync_7b_ms, broadcast_ms_by_servers, lora_sync_ms, and the budget job's budget_lora_sync_ms and
budget_peak_gpu_memory_gib (null where the stage is missing), plus
the raw figures behind them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (stage log, key in its RESULT, name in the combined RESULT, target as text)
FIGURES = [
    ("rollout", "ratio", "rollout_vs_vllm_ratio", ">= 0.95"),
    ("rollout", "server_tok_s", "rollout_server_tok_s", ""),
    ("rollout", "raw_vllm_tok_s", "raw_vllm_tok_s", ""),
    ("sync", "weight_sync_ms", "weight_sync_ms", "< 100"),
    ("sync", "nccl_floor_ms", "nccl_floor_ms", ""),
    ("e2e", "async_vs_sync_speedup", "async_vs_sync_speedup", ">= 1.6"),
    ("e2e", "staleness_mean", "staleness_mean", ""),
    ("learner", "learner_tok_s", "learner_tok_s", ""),
    ("learner", "mfu", "mfu", ""),
    ("scaling", "gpus", "gpus", ""),
    ("scaling", "scaling_vs_2gpu", "scaling_vs_2gpu", "8 GPUs >= 3.5"),
    ("scaling", "async_vs_sync", "async_vs_sync", ">= 2"),
    ("ray", "ray_vs_plain", "ray_vs_plain", "~ 1"),
    ("big", "weight_sync_ms", "weight_sync_7b_ms", "< 1000"),
    ("broadcast", "broadcast_ms_by_servers", "broadcast_ms_by_servers", ""),
    ("lora", "lora_sync_ms", "lora_sync_ms", "<= 15"),
    ("budget", "lora_sync_ms", "budget_lora_sync_ms", "<= 15"),
    ("budget", "peak_gpu_memory_gib", "budget_peak_gpu_memory_gib", "<= memory_budget_gib"),
]


def stage_result(out: Path, stage: str) -> dict:
    """Every RESULT line of the stage's log merged, a later line's key over an earlier one's."""
    log = out / f"{stage}.log"
    if not log.is_file():
        return {}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("RESULT ")]
    merged = {}
    for line in lines:
        merged |= json.loads(line[len("RESULT "):])
    return merged


def _shown(value) -> str:
    if isinstance(value, dict):
        return " ".join(f"{key}:{_shown(entry)}" for key, entry in value.items())
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
    results = {stage: stage_result(out, stage) for stage in {stage for stage, *_ in FIGURES}}
    combined = {}
    print(f"{'figure':24} {'value':>12} {'target':>14}")
    for stage, key, name, target in FIGURES:
        value = results[stage].get(key)
        combined[name] = value
        shown = "missing" if value is None else _shown(value)
        print(f"{name:24} {shown:>12} {target:>14}")
    print("RESULT " + json.dumps(combined), flush=True)


if __name__ == "__main__":
    main()
