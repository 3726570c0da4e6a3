"""One rollout server with a fixed index, in this process (the Ray launcher restarts it, not a local
supervisor). Its buffer and weight-sync addresses come from the config (buffer.address,
rollout.weight_sync.control_address), which the launcher sets.

    python -m launch.ray_cluster.serve_rollout --index I [--config FILE] KEY=VALUE...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from asyncrl.config import ConfigError, load_config
from asyncrl.config_arguments import add_config_arguments


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch.ray_cluster.serve_rollout", description=__doc__)
    parser.add_argument("--index", type=int, required=True, help="server index (server 0 also validates)")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        print(f"rollout-{args.index}: {error}", file=sys.stderr)
        return 2
    from rollout_servers.learner_wait import Endpoints
    from rollout_servers.server_process import serve_one

    endpoints = Endpoints(config.buffer.address, config.rollout.weight_sync.control_address)
    serve_one(config, args.index, endpoints, str(Path(config.run.root_dir) / config.run.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
