"""`asyncrl plot RUN_DIR`: render the run's metrics.jsonl as PNG files under RUN_DIR/plots/."""

from __future__ import annotations

import argparse
import sys


def main(args: argparse.Namespace) -> int:
    from launch.plots import NoMetricsError, plot_run

    try:
        report = plot_run(args.run_dir)
    except NoMetricsError as error:
        print(f"asyncrl plot: {error}", file=sys.stderr)
        return 1
    if report.missing:
        print(f"not in this run's metrics, left out of the plots: {', '.join(report.missing)}", file=sys.stderr)
    for path in report.written:
        print(path)
    return 0
