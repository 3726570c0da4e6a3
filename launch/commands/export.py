"""`asyncrl export RUN_DIR`: a run's checkpoint as a Hugging Face directory that transformers and vLLM load."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.logs import setup_logging

EXPORT_DIR = "export"  # under the run directory; one step_N directory per exported checkpoint


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    config = load_config(args.config or run_dir / "config.yaml", args.overrides)
    setup_logging("export", config.run.log_level)
    from learner.policy.checkpoint import CHECKPOINTS_DIR, META_FILE, latest_checkpoint
    from learner.policy.export import checkpoint_step, export_checkpoint

    checkpoint = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(run_dir / CHECKPOINTS_DIR)
    if checkpoint is None:
        print(f"asyncrl export: no complete checkpoint under {run_dir / CHECKPOINTS_DIR}", file=sys.stderr)
        return 1
    if not (checkpoint / META_FILE).is_file():
        print(f"asyncrl export: {checkpoint} is not a complete checkpoint (no {META_FILE})", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else run_dir / EXPORT_DIR / f"step_{checkpoint_step(checkpoint)}"
    if args.merged and not config.model.lora.enabled:
        print("asyncrl export: --merged needs a LoRA run (model.lora.enabled); this run trained every weight",
              file=sys.stderr)
        return 1
    export_checkpoint(checkpoint, config.model.path, config.model.dtype, out, config.model.lora, args.merged)
    print(f"EXPORT_DIR {out}", flush=True)
    return 0
