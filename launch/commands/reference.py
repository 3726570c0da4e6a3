"""`asyncrl learner` (and `asyncrl run`) with `learner.mode=synchronous`: the synchronous reference
(`launch.reference_loop`) in this process, its engine half and policy half built from their roles.

GPUs: the plan of a one-server job (docs/placement.md). One GPU is shared by the engine and the policy
(the engine's memory share lowered to leave the policy room); with two, the engine takes the server's GPU
and the policy the learner's, and the weights go over NCCL between them (not yet run on a GPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from launch.commands.common import make_run_dir
from asyncrl.config import AsyncRLConfig
from asyncrl.exit_codes import INTERRUPTED
from asyncrl.logs import setup_logging
from asyncrl.metrics import METRICS_FILE, MetricsLogger
from asyncrl.stop_signal import interrupt_on_stop_signals
from launch.reference_loop import run

ROLE = "reference"  # the process's name in its log lines and its log file, logs/reference.log


def main(config: AsyncRLConfig, log: logging.Logger) -> NoReturn:
    """Run the reference to the end, then leave at once: vLLM's engine client, finalised by the interpreter's
    teardown, raises there (its module globals are gone), and finalised earlier it can block in ZeroMQ's
    context teardown; the engine, the metrics and the process group are closed before."""
    code = _run(config, log)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _run(config: AsyncRLConfig, log: logging.Logger) -> int:
    if "WORLD_SIZE" in os.environ:
        log.error("learner.mode=synchronous runs in one process, not under torchrun or Ray")
        return 2
    from asyncrl.placement import pin, place_local_job, server_places, write_lists  # imports torch: after parsing
    from asyncrl.weight_transfer.backends import group_backend
    from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment

    plan = place_local_job(config, log, automatic=True)  # None on a machine without GPUs
    engine_gpus = None if plan is None or plan.colocated else plan.servers[0]
    if plan is not None:
        pin([*plan.learner, *(engine_gpus or ())])  # the policy's GPU first: it is cuda:0 here
        server_places(config, plan)[0].apply(config)  # the engine's memory share: lowered beside the policy
        write_lists(config, plan)  # the policy's part of a shared GPU leaves the engine its share
    prepare_nccl_environment(config.rollout.weight_sync.host)
    named = Path(config.run.root_dir) / config.run.name
    if config.run.name and (named / METRICS_FILE).exists():
        log.error("%s holds a run already, and the synchronous reference does not resume: choose another run.name", named)
        return 2
    run_dir = make_run_dir(config, "run")
    setup_logging(ROLE, config.run.log_level, run_dir / "logs" / f"{ROLE}.log")
    interrupt_on_stop_signals()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # as a rollout server: the engine shares the cores
    from learner.reference_trainer import ReferenceTrainer, close_world, open_world  # imports the roles: after parsing
    from learner.services.snapshots import SnapshotWriter
    from rollout_servers.reference_sampler import ReferenceSampler

    with contextlib.ExitStack() as opened:  # closed in reverse order, whatever fails
        world = open_world(config)  # this process's GPU before the engine's processes are given theirs
        opened.callback(close_world)
        sampler = ReferenceSampler.start(config, engine_gpus, group_backend(receiver_has_own_gpus=bool(engine_gpus)))
        opened.callback(sampler.close)
        trainer = ReferenceTrainer.load(config, world)  # after the engine: micro-batches sized from the memory it left
        metrics = opened.enter_context(contextlib.closing(MetricsLogger(run_dir, config.metrics, dataclasses.asdict(config))))
        snapshots = (opened.enter_context(contextlib.closing(
            SnapshotWriter(run_dir, config.validation.every, config.learner.total_steps)))
            if config.validation.after_run else None)
        try:
            version = run(config, run_dir, sampler, trainer, metrics, snapshots)
        except KeyboardInterrupt:
            log.warning("stopped by a signal")
            return INTERRUPTED
    log.info("trained to version %d", version)
    print(f"RUN_DIR {run_dir}", flush=True)
    return 0
