"""`asyncrl learner`: train. Spawns learner.nproc local ranks, or joins the world torchrun gives."""

from __future__ import annotations

import argparse
import os

from asyncrl.commands.common import make_run_dir, start
from asyncrl.config import AsyncRLConfig
from asyncrl.endpoints import ENDPOINTS_FILE
from asyncrl.net import free_port
from asyncrl.sync_mode import apply_mode


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "learner")
    config = apply_mode(config, log)
    from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment  # imports torch: after parsing

    prepare_nccl_environment(config.rollout.weight_sync.host)
    run_dir = make_run_dir(config, "run")
    (run_dir / ENDPOINTS_FILE).unlink(missing_ok=True)  # rollout servers wait for this run's addresses
    log.info("run directory: %s", run_dir)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank of the given world
        from learner.main import train

        train(config, run_dir)
    else:
        spawn_ranks(config, str(run_dir))
    print(f"RUN_DIR {run_dir}", flush=True)
    return 0


def spawn_ranks(config: AsyncRLConfig, run_dir: str) -> None:
    import torch.multiprocessing as mp

    from learner.main import spawned_rank

    size = config.learner.nproc
    mp.start_processes(spawned_rank, args=(size, free_port(), config, run_dir), nprocs=size, start_method="spawn")

