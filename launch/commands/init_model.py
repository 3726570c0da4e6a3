"""`asyncrl init-model`: build and warm-start the tiny default model (cached)."""

from __future__ import annotations

import argparse
import json

from launch.commands.common import start


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "init-model")
    from demo.tiny.build import init_model
    from rollout_servers.rewards.builtin import scorer_for

    report = init_model(config, scorer_for)
    print(json.dumps({"model_path": config.model.path} | report))
    return 0
