"""Entry point of one learner rank: join the learner's process group, load the policy, resume, then run the
loop while this rank's services (rank 0's: the buffer, weight sync and metrics) serve beside it."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from asyncrl.config import AsyncRLConfig
from asyncrl.exit_codes import INTERRUPTED
from asyncrl.heap import ended_normally, freeze_startup_heap
from asyncrl.learner_plan import write_plan
from asyncrl.logs import setup_logging
from asyncrl.parent_death import die_with_spawning_parent
from asyncrl.stop_signal import interrupt_once
from learner.distributed import World, init_world, local_rank_environment
from learner.loop import run_loop
from learner.loop_state import LoopState, resume_state
from learner.policy.policy_model import DTYPES
from learner.policy.policy_trainer import PolicyTrainer
from learner.services.rank_services import rank_services

log = logging.getLogger(__name__)


def train(config: AsyncRLConfig, run_dir: Path, buffer_command: Sequence[str]) -> LoopState:
    """Run this rank to learner.total_steps (torchrun-style environment variables give the world); rank 0 starts
    its own buffer with `buffer_command` (the command line of `asyncrl buffer`) unless buffer.address names one."""
    rank = int(os.environ.get("RANK", "0"))  # the world's, read before joining it: the start-up's phases are logged
    setup_logging(f"learner{rank}", config.run.log_level, run_dir / "logs" / f"learner{rank}.log")
    log.info("learner rank %d: joining the learner's process group", rank)
    joining = time.perf_counter()
    with learner_world(config) as world:
        log.info("joined the process group (%d rank(s), %s) in %.1fs; loading the policy", world.size, world.device,
                 time.perf_counter() - joining)
        warn_if_updates_round_away(config)
        loading = time.perf_counter()
        trainer = PolicyTrainer.load(config, world)
        if world.is_main:
            write_plan(run_dir, trainer.plan())  # what `asyncrl tune` reads: auto settings resolved
        state = resume_state(config, run_dir, trainer.model, trainer.optimizer, world)
        log.info("policy loaded in %.1fs", time.perf_counter() - loading)
        with rank_services(config, run_dir, world, trainer.model, state, buffer_command) as services:
            freeze_startup_heap()  # torch, the model and the services live as long as this rank
            state = run_loop(config, run_dir, state, trainer, services)
            services.finish(state.step)
    return state


@contextmanager
def learner_world(config: AsyncRLConfig) -> Iterator[World]:
    """This rank in the learner's process group, which it leaves on the way out. A run that ended normally leaves
    it together (a barrier first): a rank that destroys its group and exits while a peer is still busy (rank 0
    telling the servers the job ended) closes the peer's connections under it, and the peer may abort. After an
    error there is no barrier: a peer may have died, and the barrier would wait for it."""
    world = init_world(config.learner.device, cpu_collectives=config.learner.cpu_offload)
    try:
        yield world
        dist.barrier()
    finally:
        dist.destroy_process_group()


def warn_if_updates_round_away(config: AsyncRLConfig) -> None:
    """16-bit master weights keep a step only where it reaches half a unit of the weight's last place."""
    dtype = DTYPES[config.learner.master_dtype]
    if dtype.itemsize >= torch.float32.itemsize:
        return
    resolution = torch.finfo(dtype).eps / 2
    log.warning("learner.master_dtype=%s: an optimizer step smaller than %.1e times a weight is rounded away "
                "(AdamW moves each weight by about learner.lr=%g); float32 keeps every step",
                config.learner.master_dtype, resolution, config.learner.lr)


def rank_in_this_process(config: AsyncRLConfig, run_dir: Path, buffer_command: Sequence[str]) -> int:
    """The only rank of a one-rank learner, trained in the `asyncrl learner` process itself: a spawned rank starts
    a fresh interpreter and imports torch and the learner again, which this process has already done (on a 2-core
    box the learner's addresses, which the servers wait for, came 10 s after launch instead of 6 s). SIGTERM is
    taken like Ctrl-C, once, as in a spawned rank. Returns 0, INTERRUPTED after a stop signal, or 1 after an error
    (its traceback in the rank's log, one line on the console)."""
    interrupt_once()
    try:
        train(config, run_dir, buffer_command)
    except KeyboardInterrupt:  # `train` closed the services on its way out; the command says it was stopped
        return INTERRUPTED
    except Exception as error:
        log.exception("learner rank 0 failed: %s: %s", type(error).__name__, error)
        return 1
    return 0


def spawned_rank(rank: int, size: int, port: int, config: AsyncRLConfig, run_dir: str,
                 buffer_command: Sequence[str]) -> None:
    """Target of the local spawner: set the torchrun-style variables, then train. SIGTERM is taken like Ctrl-C
    (once), so that a stopped rank unwinds through `train`'s cleanup (torch's spawn wrapper ends it quietly)."""
    die_with_spawning_parent()  # `asyncrl learner` killed outright takes its ranks (and their buffer) along
    interrupt_once()  # the group's signal and the one `asyncrl learner` forwards: the second must not cut the cleanup
    os.environ.update(local_rank_environment(rank, size, port))
    try:
        train(config, Path(run_dir), buffer_command)
    except Exception as error:  # its reason and traceback into the rank's log (the console gets one line)
        log.exception("learner rank %d failed: %s: %s", rank, type(error).__name__, error)
        raise
    ended_normally()
