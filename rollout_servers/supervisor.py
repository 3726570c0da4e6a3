"""`asyncrl rollout`: start N rollout server processes and keep them running.

A server that exits is restarted with exponential back-off. It resumes its numbered prompt stream from
the state it keeps in the run dir: the prompts its previous process drew and never got acknowledged
are regenerated first (under the grants the buffer still counts for it), each group under the same
record id, so every prompt reaches the buffer exactly once (see `rollout_servers.prompt_stream`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

from asyncrl.config import AsyncRLConfig
from asyncrl.endpoints import ENDPOINTS_FILE
from asyncrl.exit_codes import CANNOT_START
from asyncrl.stop_signal import StopSignal
from asyncrl.logs import setup_logging
from rollout_servers.server import Endpoints, RolloutServer

log = logging.getLogger(__name__)

_POLL_S = 0.5  # supervisor's check interval for dead servers and the stop signal
STATE_DIR = "rollout"  # under the run dir: each server's prompt-stream position (`PromptStream`)


class ServerCannotStart(RuntimeError):
    """A server could not be built from the config's inputs; its log holds the reason."""


def find_endpoints(config: AsyncRLConfig, run_dir: Path, timeout_s: float) -> Endpoints:
    """Explicit addresses from config, else the learner's endpoints file in the run dir (waited for)."""
    if config.buffer.address and config.rollout.weight_sync.control_address:
        return Endpoints(config.buffer.address, config.rollout.weight_sync.control_address)
    path = run_dir / ENDPOINTS_FILE
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no learner endpoints at {path} after {timeout_s:.0f}s: start `asyncrl learner` with the same "
                "run.name, or set buffer.address and rollout.weight_sync.control_address"
            )
        time.sleep(_POLL_S)
    found = json.loads(path.read_text())
    return Endpoints(config.buffer.address or found["buffer"], config.rollout.weight_sync.control_address or found["sync"])


def supervise(config: AsyncRLConfig, run_dir: Path, endpoints_dir: Path) -> None:
    """Run `rollout.num_servers` servers until SIGINT/SIGTERM; restart the ones that die. Endpoints are
    looked up at every (re)start, so servers follow a learner that restarted on new addresses."""
    context = multiprocessing.get_context("spawn")
    stop = StopSignal()
    restarts = [0] * config.rollout.num_servers
    next_start = [0.0] * config.rollout.num_servers
    processes: list[multiprocessing.Process | None] = [None] * config.rollout.num_servers
    try:
        while not stop.requested:
            for index, process in enumerate(processes):
                if process is not None and process.is_alive():
                    continue
                if process is not None and process.exitcode == CANNOT_START:
                    raise ServerCannotStart(f"server-{index} cannot start from this config (not restarted): see "
                                            f"{server_log(run_dir, index)}")
                if process is not None:
                    restarts[index] += 1
                    delay = min(config.rollout.restart_backoff_s * 2 ** (restarts[index] - 1), config.rollout.restart_backoff_max_s)
                    log.warning("server-%d exited with code %s; restart %d in %.1fs", index, process.exitcode, restarts[index], delay)
                    next_start[index] = time.monotonic() + delay
                    processes[index] = None
                if time.monotonic() >= next_start[index]:
                    endpoints = find_endpoints(config, endpoints_dir, config.rollout.connect_timeout_s)
                    processes[index] = context.Process(target=_serve, args=(config, index, endpoints, str(run_dir)), daemon=False)
                    processes[index].start()
            time.sleep(_POLL_S)
    finally:
        _stop_all([p for p in processes if p is not None], config.rollout.stop_timeout_s)


def server_log(run_dir: Path | str, index: int) -> Path:
    """Where server `index` of the run in `run_dir` logs."""
    return Path(run_dir) / "logs" / f"rollout{index}.log"


def _serve(config: AsyncRLConfig, index: int, endpoints: Endpoints, run_dir: str) -> None:
    setup_logging(f"rollout{index}", config.run.log_level, server_log(run_dir, index))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        server = RolloutServer(config, index, endpoints, Path(run_dir) / STATE_DIR)
    except Exception as error:
        log.exception("server-%d cannot start: %s: %s", index, type(error).__name__, error)
        sys.exit(CANNOT_START)
    try:
        asyncio.run(server.serve())
    except KeyboardInterrupt:
        log.info("server-%d stopped", index)


def _stop_all(processes: list[multiprocessing.Process], timeout_s: float) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0))
        if process.is_alive():
            process.kill()
            process.join()
