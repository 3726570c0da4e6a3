"""`asyncrl launch`: the whole job on a Ray cluster (launch/ray_cluster/), `RUN_DIR <path>` last."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from launch.commands.common import start
from asyncrl.placement import check_ray_placement


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "launch")
    if config.learner.mode == "synchronous":
        print("asyncrl launch: learner.mode=synchronous runs in one process: use `asyncrl run` or `asyncrl learner`", file=sys.stderr)
        return 2

    check_ray_placement(config)  # a ConfigError: refused before anything starts, as `asyncrl run` refuses its plan
    name = config.run.name or f"launch-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(config.run.root_dir).absolute() / name
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # read when Ray is imported: every role line, none folded away
    try:
        from launch.ray_cluster.launcher import LaunchError, launch
    except ModuleNotFoundError as error:
        if error.name != "ray":
            raise
        print("asyncrl launch: Ray is not installed: pip install 'asyncrl[ray]'", file=sys.stderr)
        return 2
    try:
        code = launch(config, args.config, args.overrides, run_dir)
    except LaunchError as error:
        print(f"asyncrl launch: {error}", file=sys.stderr)
        code = error.exit_code
    print(f"RUN_DIR {run_dir}", flush=True)
    return code
