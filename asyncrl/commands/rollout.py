"""`asyncrl rollout`: run rollout.num_servers vLLM servers for a learner (same config and run.name)."""

from __future__ import annotations

import argparse
from pathlib import Path

from asyncrl.commands.common import check_input_files, start


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "rollout")
    if config.learner.mode == "sync":
        log.error("learner.mode=sync: the learner runs its own vLLM engine; it needs no rollout servers")
        return 2
    check_input_files(config)
    from asyncrl.placement import place_local_job  # imports torch: after parsing
    from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment

    plan = place_local_job(config, log)

    prepare_nccl_environment(config.rollout.weight_sync.host)
    run_dir = Path(config.run.root_dir) / config.run.name if config.run.name else None
    from rollout_servers.supervisor import SupervisorGaveUp, find_endpoints, supervise

    if run_dir is None and not (config.buffer.address and config.rollout.weight_sync.control_address):
        log.error("set run.name (the learner's run) or buffer.address and rollout.weight_sync.control_address")
        return 2
    endpoints = find_endpoints(config, run_dir or Path("."), config.rollout.connect_timeout_s)
    log.info("starting %d servers for buffer %s, weight sync %s", config.rollout.num_servers, endpoints.buffer, endpoints.sync)
    try:
        supervise(config, run_dir or Path(config.run.root_dir) / "rollout", run_dir or Path("."),
                  plan.servers if plan is not None else None)
    except SupervisorGaveUp as error:
        log.error("%s", error)
        return 1
    return 0
