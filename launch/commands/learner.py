"""`asyncrl learner`: train. One rank trains in this process; more are spawned (learner.nproc local ranks); or this
process joins the world torchrun gives."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path
from typing import Callable

from launch.commands.buffer import COMMAND_LINE
from launch.commands.common import make_run_dir, start
from asyncrl.endpoints import ENDPOINTS_FILE
from asyncrl.exit_codes import INTERRUPTED
from asyncrl.gpu_ids import pin
from asyncrl.heap import ended_normally
from asyncrl.placement import place_local_job
from asyncrl.stop_signal import interrupt_on_stop_signals


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


def spawn_ranks(target: Callable[..., None], args: tuple, size: int, run_dir: str, role: str,
                log: logging.Logger) -> int:
    """Run `size` local ranks, `target(rank, size, store_port, *args)` each, to the end; the exit code: 0,
    INTERRUPTED when a stop signal ended them first, 1 when one failed (one line here; its error and traceback are in
    its log, logs/<role><rank>.log).

    SIGTERM (what `asyncrl run` sends the learner's process group) is taken like Ctrl-C, here and in every
    rank: a rank unwinds through its `finally` (buffer stopped, metrics closed, its process group left) and
    exits, and this process waits for that. A signal to this process alone (a process manager's) is passed on
    to the ranks. Killed outright, a rank left the multiprocessing resource tracker
    warning about a leaked semaphore (tqdm's, from loading the model) on the console."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from learner.distributed import spawner_store

    interrupt_on_stop_signals()
    store = spawner_store(size) if size > 1 else None  # held here until the ranks end
    context = mp.start_processes(target, args=(size, store.port if store else 0, *args), nprocs=size,
                                 start_method="spawn", join=False)
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        for process in context.processes:  # a signal to this process alone (a process manager's) reaches them too
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        for process in context.processes:
            process.join()
        return INTERRUPTED
    except ProcessException as error:  # torch ends the other ranks
        rank_log = Path(run_dir) / "logs" / f"{role}{error.error_index}.log"
        log.error("%s rank %d failed (%s): see %s", role, error.error_index, str(error).strip().splitlines()[0], rank_log)
        return 1
    return 0

