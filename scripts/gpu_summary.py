"""Combine the RESULT lines of scripts/gpu_bench.sh's stage logs into one table and one RESULT line.

Usage: python scripts/gpu_summary.py OUT_DIR. Stages that did not run (or failed) show as missing.
Last line: RESULT {json} with rollout_vs_vllm_ratio, weight_sync_ms, nccl_floor_ms,
async_vs_sync_speedup and mfu (null where the stage is missing), plus the raw figures behind them.
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
]


def stage_result(out: Path, stage: str) -> dict:
    log = out / f"{stage}.log"
    if not log.is_file():
        return {}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else {}


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
    results = {stage: stage_result(out, stage) for stage in {stage for stage, *_ in FIGURES}}
    combined = {}
    print(f"{'figure':24} {'value':>12} {'target':>8}")
    for stage, key, name, target in FIGURES:
        value = results[stage].get(key)
        combined[name] = value
        shown = "missing" if value is None else _number(value)
        print(f"{name:24} {shown:>12} {target:>8}")
    print("RESULT " + json.dumps(combined), flush=True)


if __name__ == "__main__":
    main()
