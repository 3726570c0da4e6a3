"""`asyncrl learner` (and `asyncrl run`) with `learner.mode=synchronous`: the synchronous reference
(`launch.reference_loop`), its engine half and policy half built from their roles, in this process or, with
`learner.nproc` > 1, in that many local ranks (colocated: each with its own engine on its own GPU).

GPUs: the plan of a one-server job (docs/placement.md). One GPU is shared by the engine and the policy
(the engine's memory share lowered to leave the policy room); with two and one rank, the engine takes the server's
GPU and the policy the learner's, and the weights go over NCCL between them (not yet run on a GPU). With N ranks
every rank's GPU is shared: its engine beside its policy shard, the weights loaded by CUDA IPC."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Sequence

from launch.commands.common import make_run_dir
from launch.local_ranks import spawn_ranks
from asyncrl.config import AsyncRLConfig
from asyncrl.exit_codes import INTERRUPTED
from asyncrl.heap import leave_now
from asyncrl.logs import setup_logging
from asyncrl.metrics import METRICS_FILE, MetricsLogger
from asyncrl.parent_death import die_with_spawning_parent
from asyncrl.placement import place_local_job, server_places, write_lists
from asyncrl.stop_signal import interrupt_on_stop_signals, interrupt_once
from launch.reference_loop import run

if TYPE_CHECKING:
    from learner.distributed import World
    from rollout_servers.reference_sampler import ReferenceSampler

ROLE = "reference"  # the process's name in its log lines and its log file: logs/reference.log, or reference<rank>.log

EngineGpus = Sequence[int] | None  # a rank's engine's GPUs (physical ids); None: those the rank sees (no GPU)


def main(config: AsyncRLConfig, log: logging.Logger) -> NoReturn:
    """Run the reference to the end, then leave at once: vLLM's engine client, finalised by the interpreter's
    teardown, raises there (its module globals are gone), and finalised earlier it can block in ZeroMQ's
    context teardown; the engine, the metrics and the process group are closed before."""
    leave_now(_run(config, log))


def _run(config: AsyncRLConfig, log: logging.Logger) -> int:
    if "WORLD_SIZE" in os.environ:
        log.error("learner.mode=synchronous starts its own ranks (learner.nproc), not under torchrun or Ray")
        return 2
    from asyncrl.gpu_ids import pin
    from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment

    plan = place_local_job(config, log, automatic=True)  # None on a machine without GPUs
    ranks = config.learner.nproc
    apart = plan is not None and not plan.colocated  # one rank, its engine on a GPU of its own
    if plan is None:
        engines: list[EngineGpus] = [None] * ranks
    else:
        engines = [plan.servers[0]] if apart else [(gpu,) for gpu in plan.learner]  # beside: each rank's own GPU
        pin([*plan.learner, *(plan.servers[0] if apart else ())])  # rank r's GPU is cuda:r here and in the ranks
        server_places(config, plan)[0].apply(config)  # the engine's memory share: lowered beside the policy
        write_lists(config, plan)  # the policy's part of a shared GPU leaves the engine its share
    prepare_nccl_environment(config.rollout.weight_sync.host)
    named = Path(config.run.root_dir) / config.run.name
    if config.run.name and (named / METRICS_FILE).exists():
        log.error("%s holds a run already, and the synchronous reference does not resume: choose another run.name", named)
        return 2
    run_dir = make_run_dir(config, "run")
    if ranks == 1:
        interrupt_on_stop_signals()
        code = _run_rank(config, run_dir, engines[0], apart, ROLE)
    else:
        code = spawn_ranks(spawned_rank, (config, str(run_dir), engines), ranks, str(run_dir), ROLE, log)
    print(f"RUN_DIR {run_dir}", flush=True)
    return code


def spawned_rank(rank: int, size: int, port: int, config: AsyncRLConfig, run_dir: str,
                 engines: list[EngineGpus]) -> None:
    """Target of the local spawner (`spawn_ranks`): rank `rank` of `size` colocated ranks, its engine on
    `engines[rank]`. SIGTERM is taken like Ctrl-C (once), so that a stopped rank closes its engine; a rank stopped
    so exits 0, as an async learner rank does, and the spawner reports the stop."""
    die_with_spawning_parent()  # `asyncrl learner` killed outright takes its ranks (and their engines) along
    interrupt_once()
    code = _run_rank(config, Path(run_dir), engines[rank], False, f"{ROLE}{rank}", rank, size, port)
    # What a multiprocessing child runs as it ends, short of the interpreter's teardown (`main` says why not that): its
    # finalizers, which release the semaphores it made (tqdm's lock); left to the spawner's resource tracker, they
    # were reported as leaked on the console at every clean end.
    multiprocessing.util._exit_function()
    leave_now(0 if code == INTERRUPTED else code)


def _run_rank(config: AsyncRLConfig, run_dir: Path, engine_gpus: EngineGpus, apart: bool, role: str, rank: int = 0,
              ranks: int = 1, store_port: int = 0) -> int:
    """This process's rank `rank` of `ranks` (meeting at their spawner's store on `store_port`) of the reference:
    its engine on `engine_gpus` (on GPUs of its own when `apart`, else beside it), its policy shard, the loop; rank 0
    records. The exit code: 0, or INTERRUPTED after a stop signal."""
    log = logging.getLogger(__name__)
    setup_logging(role, config.run.log_level, run_dir / "logs" / f"{role}.log")
    from learner.reference_trainer import ReferenceTrainer  # imports the roles: after parsing
    from learner.services.snapshots import SnapshotWriter

    try:
        with contextlib.ExitStack() as opened:  # closed in reverse order, whatever fails
            world, sampler = _engine_and_world(opened, config, engine_gpus, apart, rank, ranks, store_port)
            trainer = ReferenceTrainer.load(config, world)  # after the engine: micro-batches fit the memory it left
            metrics = (opened.enter_context(contextlib.closing(
                MetricsLogger(run_dir, config.metrics, dataclasses.asdict(config)))) if world.is_main else None)
            snapshots = (opened.enter_context(contextlib.closing(
                SnapshotWriter(run_dir, config.validation.every, config.learner.total_steps)))
                if config.validation.after_run and world.is_main else None)
            version = run(config, run_dir, sampler, trainer, metrics, snapshots)
    except KeyboardInterrupt:
        log.warning("stopped by a signal")
        return INTERRUPTED
    log.info("trained to version %d", version)
    return 0


def _engine_and_world(opened: contextlib.ExitStack, config: AsyncRLConfig, engine_gpus: EngineGpus, apart: bool,
                      rank: int, ranks: int, store_port: int) -> tuple[World, ReferenceSampler]:
    """This rank's started engine and its process group, both closed by `opened`. The engine first: vLLM forks the
    engine's core from a process that has not opened CUDA, where after the process group opened it (the rank's
    device) it must spawn it, importing torch and vLLM again (~20 s of a 44 s start on an H200). The engine's
    processes see only its GPUs (`_visible_to_children`); this process opens CUDA after they started, with its own
    view of the GPUs."""
    from asyncrl.weight_transfer.backends import group_backend
    from learner.distributed import local_rank_environment
    from learner.main import learner_world
    from rollout_servers.reference_sampler import ReferenceSampler

    sampler = ReferenceSampler.start(config, engine_gpus, group_backend(receiver_has_own_gpus=apart), rank, ranks)
    opened.callback(sampler.close)
    if ranks > 1:
        os.environ.update(local_rank_environment(rank, ranks, store_port))
    world = opened.enter_context(learner_world(config))
    for key in local_rank_environment(0, 1, 0):  # they served the join: no process started later meets at the store
        os.environ.pop(key, None)
    return world, sampler
