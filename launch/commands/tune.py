"""`asyncrl tune RUN_DIR`: say whether a finished run was generation-, learner- or sync-bound, what K, servers and
micro-batch to try, and which split of the GPUs between servers and learner ranks keeps both busy (launch/tuning.py,
launch/gpu_split.py; docs/tuning.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(args: argparse.Namespace) -> int:
    from asyncrl.config import load_config
    from asyncrl.learner_plan import read_plan
    from launch.gpu_split import split_advice
    from launch.plots import NoMetricsError, load_records
    from launch.tuning import NotEnoughSteps, RunSettings, advise, read_run, read_steps

    run_dir = Path(args.run_dir)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        print(f"asyncrl tune: no config.yaml in {run_dir}: is it a run directory (see `RUN_DIR` printed by asyncrl run)?",
              file=sys.stderr)
        return 1
    if args.gpus is not None and not (args.gpus.isdigit() and int(args.gpus) > 0):
        print(f"asyncrl tune: --gpus {args.gpus}: give the host's number of GPUs, a whole number above 0", file=sys.stderr)
        return 1
    try:
        records = load_records(run_dir)
        reading = read_run(records)
    except (NoMetricsError, NotEnoughSteps) as error:
        print(f"asyncrl tune: {error}", file=sys.stderr)
        return 1
    config = load_config(config_file)
    gpus = int(args.gpus) if args.gpus else None
    settings = RunSettings.of(config, read_plan(run_dir))
    for line in advise(reading, settings) + split_advice(read_steps(records), config, gpus):
        print(line)
    return 0

