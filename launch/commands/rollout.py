"""`asyncrl rollout`: run rollout.num_servers vLLM servers for a learner (same run.name), with the job's shared
settings taken from the learner's config, until the learner finishes the job or a signal stops them."""

from __future__ import annotations

import argparse
import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config import AsyncRLConfig, ConfigError
from launch.commands.common import check_input_files, start
from launch.commands.model_check import check_model
from asyncrl.exit_codes import INTERRUPTED
from asyncrl.heap import ended_normally
from asyncrl.placement import Plan, place_local_job, server_places
from launch.job_settings import adopt_learner_settings

if TYPE_CHECKING:
    from rollout_servers.server_starts import ServerStarts


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "rollout")
    if config.learner.mode == "synchronous":
        log.error("learner.mode=synchronous: the learner runs its own vLLM engine; it needs no rollout servers")
        return 2
    run_dir = Path(config.run.root_dir) / config.run.name if config.run.name else None
    if run_dir is None and not (config.buffer.address and config.rollout.weight_sync.control_address):
        log.error("set run.name (the learner's run) or buffer.address and rollout.weight_sync.control_address")
        return 2
    from rollout_servers.server_starts import ServerStarts  # without torch, which this process loads after

    servers_dir = run_dir or Path(config.run.root_dir) / "rollout"
    starts = ServerStarts.warm_up(config, servers_dir)  # the servers' processes import while the learner starts
    try:
        return _serve(config, args, run_dir, servers_dir, starts, log)
    finally:
        starts.close()


def _serve(config: AsyncRLConfig, args: argparse.Namespace, run_dir: Path | None, servers_dir: Path,
           starts: ServerStarts, log: logging.Logger) -> int:
    """Check the job, wait for the learner, adopt its settings and supervise the servers to the end; the exit code."""
    from rollout_servers.learner_wait import LearnerFinished
    from rollout_servers.supervisor import SupervisorGaveUp, find_endpoints, supervise

    try:
        early = _checked_early(config, log)  # while the learner starts too
        endpoints = find_endpoints(config, run_dir or Path("."), config.rollout.connect_timeout_s)  # the learner is up
        adopted = adopt_learner_settings(config, run_dir, args.overrides, log) if run_dir is not None else config
        config, plan = _settled(config, adopted, early, log)
        log.info("starting %d servers for buffer %s, weight sync %s", config.rollout.num_servers, endpoints.buffer,
                 endpoints.sync)
        final_step = supervise(config, servers_dir, run_dir or Path("."),
                               server_places(config, plan) if plan is not None else None, starts)
    except LearnerFinished as finished:
        final_step = finished.version
    except SupervisorGaveUp as error:
        log.error("%s", error)
        return error.exit_code
    if final_step is None:
        log.info("stopped by a signal: the rollout servers are stopped")
        return INTERRUPTED
    log.info("the learner finished the job at step %d: the rollout servers are stopped", final_step)
    ended_normally()
    return 0


@dataclass
class EarlyCheck:
    config: AsyncRLConfig | None  # this command's own settings as checked (weight backend resolved); None: failed
    plan: Plan | None  # their GPU plan


def _checked(config: AsyncRLConfig, log: logging.Logger) -> Plan | None:
    """The job's input files, GPU plan (`config`'s weight backend set to what it allows) and model, checked before any
    server starts; ConfigError naming what is wrong."""
    check_input_files(config)
    plan = place_local_job(config, log)
    check_model(config)
    return plan


def _settled(own: AsyncRLConfig, adopted: AsyncRLConfig, early: EarlyCheck,
             log: logging.Logger) -> tuple[AsyncRLConfig, Plan | None]:
    """The job's checked config and plan: the early check's where the learner's shared settings are this command's
    `own`, else `adopted` checked now (its ConfigError is the command's)."""
    if early.config is not None and adopted == own:
        return early.config, early.plan
    return adopted, _checked(adopted, log)


def _checked_early(config: AsyncRLConfig, log: logging.Logger) -> EarlyCheck:
    """`_checked` on a copy of this command's own settings, before the learner is up: a job whose learner has the same
    shared settings (`asyncrl run`) is then checked by the time the learner's addresses come (4 s of a 2-core box's
    start). Settings that fail here may be the learner's to give (an `asyncrl rollout` given only `run.name`): they
    are checked again once adopted, and only that check's error counts."""
    own = copy.deepcopy(config)
    try:
        return EarlyCheck(own, _checked(own, log))
    except ConfigError as error:
        log.debug("own settings not checked before the learner's: %s", error)
        return EarlyCheck(None, None)
