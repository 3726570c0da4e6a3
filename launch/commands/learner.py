"""`asyncrl learner`: train. One rank trains in this process; more are spawned (learner.nproc local ranks); or this
process joins the world torchrun gives."""

from __future__ import annotations

import argparse
import os

from launch.commands.buffer import COMMAND_LINE
from launch.commands.common import make_run_dir, start
from launch.local_ranks import spawn_ranks
from asyncrl.endpoints import ENDPOINTS_FILE
from asyncrl.exit_codes import INTERRUPTED
from asyncrl.gpu_ids import pin
from asyncrl.heap import ended_normally
from asyncrl.placement import place_local_job


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "learner")
    if config.learner.mode == "synchronous":  # the synchronous reference: each rank with its own engine
        from launch.commands import reference

        return reference.main(config, log)
    torchrun = "WORLD_SIZE" in os.environ  # torchrun or Ray gave this process its rank and its GPUs
    from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment

    plan = None if torchrun else place_local_job(config, log)

    prepare_nccl_environment(config.rollout.weight_sync.host)
    run_dir = make_run_dir(config, "run")
    (run_dir / ENDPOINTS_FILE).unlink(missing_ok=True)  # rollout servers wait for this run's addresses
    log.info("run directory: %s", run_dir)
    if torchrun:  # this process is one rank of the given world
        from learner.main import train

        train(config, run_dir, COMMAND_LINE)
        print(f"RUN_DIR {run_dir}", flush=True)
        ended_normally()
        return 0
    if plan is not None:
        pin(plan.learner)  # the ranks see their GPUs as 0..nproc-1 (CUDA is first opened after this, by a rank)
    from learner.main import rank_in_this_process, spawned_rank

    if config.learner.nproc == 1:
        code = rank_in_this_process(config, run_dir, COMMAND_LINE)
    else:
        code = spawn_ranks(spawned_rank, (config, str(run_dir), COMMAND_LINE), config.learner.nproc, str(run_dir),
                           "learner", log)
    if code == INTERRUPTED:
        log.warning("stopped by a signal: the ranks closed their services and exited")
    print(f"RUN_DIR {run_dir}", flush=True)
    if code == 0:
        ended_normally()
    return code
