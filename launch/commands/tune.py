"""`asyncrl tune RUN_DIR`: say whether a finished run was generation-, learner- or sync-bound and what K,
servers and micro-batch to try (launch/tuning.py; docs/tuning.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(args: argparse.Namespace) -> int:
    from asyncrl.config import load_config
    from launch.plots import NoMetricsError, load_records
    from launch.tuning import NotEnoughSteps, RunSettings, advise, read_run

    run_dir = Path(args.run_dir)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        print(f"asyncrl tune: no config.yaml in {run_dir}: is it a run directory (see `RUN_DIR` printed by asyncrl run)?",
              file=sys.stderr)
        return 1
    try:
        reading = read_run(load_records(run_dir))
    except (NoMetricsError, NotEnoughSteps) as error:
        print(f"asyncrl tune: {error}", file=sys.stderr)
        return 1
    for line in advise(reading, RunSettings.of(load_config(config_file))):
        print(line)
    return 0
