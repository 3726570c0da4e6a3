"""`asyncrl run`: the whole job on this machine: learner (which starts the buffer) plus rollout servers,
live progress on the console, per-role logs in the run directory, clean stop on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.config import AsyncRLConfig, ConfigError
from launch.commands.common import check_input_files, start
from launch.commands.model_check import check_model
from launch.mps import MpsDaemon, start_mps
from asyncrl.endpoints import ENDPOINTS_FILE
from asyncrl.exit_codes import INTERRUPTED
from asyncrl.heap import ended_normally
from asyncrl.parent_death import launched_environment
from asyncrl.placement import Plan, as_overrides, place_local_job
from asyncrl.stop_signal import StopSignal

_POLL_S = 0.5  # how often the launcher checks its children
_STOP_TIMEOUT_S = 30.0  # grace period after SIGTERM before SIGKILL
_ERRORS_SHOWN = 3  # error records of the rollout supervisor's log repeated on the console when it gives up
_CONTINUATION_LINES = 6  # indented lines shown after an error line (a DataError lists up to 5 rows and a count)


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "run")
    check_input_files(config)

    plan = place_local_job(config, log, automatic=True)  # refused here, before any role starts
    name = config.run.name or f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(config.run.root_dir) / name
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / ENDPOINTS_FILE).unlink(missing_ok=True)  # a resumed run's old addresses must not be used
    mps = start_mps(config, plan, run_dir, log)  # before the roles: their CUDA contexts become its clients
    try:
        return run_roles(args, config, log, name, run_dir, plan, mps)
    finally:
        if mps is not None:
            mps.follow(log, final=True)
            mps.stop()


def run_roles(args: argparse.Namespace, config: AsyncRLConfig, log: logging.Logger, name: str, run_dir: Path,
              plan: Plan | None, mps: MpsDaemon | None) -> int:
    """Start the learner and (async) the rollout supervisor, follow them to the job's end or a stop, stop them."""
    base = [sys.executable, "-m", "launch.cli"]
    placed = as_overrides(plan) if plan is not None else []  # each role pins itself to its GPUs of the plan
    shared = (["--config", args.config] if args.config else []) + [*args.overrides, *placed, f"run.name={name}"]
    # The learner's progress lines (stderr) go to the console; its stdout (RUN_DIR) and the rollout
    # supervisor's output go to logs/.
    environment = launched_environment() | (mps.environment() if mps is not None else {})
    learner = _launch(base + ["learner", *shared], run_dir / "logs" / "learner.out", environment,
                      stderr_to_console=True)
    # learner.mode=synchronous: the learner runs the synchronous reference, which owns its engine
    rollout = (None if config.learner.mode == "synchronous"
               else _launch(base + ["rollout", *shared], run_dir / "logs" / "rollout.log", environment))
    log.info("run directory %s: learner pid %d, rollout pid %s (servers log to logs/)", run_dir, learner.pid,
             rollout.pid if rollout else "none")
    check_model_beside(config, [process for process in (rollout, learner) if process is not None])
    stop = StopSignal()
    code = 0
    try:
        while not stop.requested and learner.poll() is None:
            if rollout is not None and rollout.poll() not in (None, 0):  # 0: the learner told it the job is finished
                log.error("rollout supervisor exited with code %s (see %s)", rollout.returncode, run_dir / "logs")
                for line in last_errors(run_dir / "logs" / "rollout.log"):
                    log.error("  %s", line)
                code = rollout.returncode  # CANNOT_START: the servers cannot start or run from this config or install
                break
            if mps is not None:
                mps.follow(log)
            time.sleep(_POLL_S)
        if stop.requested:
            code = INTERRUPTED
        elif code == 0:
            code = learner.returncode or 0
    finally:
        # A job that ended well has told the servers so, and they are stopping on their own: a signal now would reach
        # engine cores mid-shutdown (an EngineDeadError traceback in rollout.log at every clean end).
        finished = learner.poll() == 0 and code == 0 and not stop.requested
        for process in (rollout, learner):
            if process is not None:
                _stop(process, own_stop_s=config.rollout.stop_timeout_s if finished else 0.0)
    print(f"RUN_DIR {run_dir}", flush=True)
    if code == 0:
        ended_normally()
    return code


def check_model_beside(config: AsyncRLConfig, roles: list[subprocess.Popen]) -> None:
    """`check_model` while the roles start: loading the tokenizer took 9 s of a GPU host's launch before them. A model
    they cannot serve stops them at once, and its ConfigError, naming what is missing, is the command's."""
    try:
        check_model(config)
    except ConfigError:
        for process in roles:
            _stop(process)
        raise


def last_errors(log_path: Path, count: int = _ERRORS_SHOWN) -> list[str]:
    """The last `count` error records of a log (why a child gave up), oldest first: each ERROR line with the
    indented lines that continue its message (a DataError's rows, say); tracebacks stay in the log."""
    if not log_path.is_file():
        return []
    records: list[list[str]] = []
    continues = False  # the line before belongs to an error record that may go on
    for line in log_path.read_text(errors="replace").splitlines():
        if " ERROR " in line:
            records.append([line])
            continues = True
        elif continues and line.startswith("  ") and len(records[-1]) <= _CONTINUATION_LINES:
            records[-1].append(line)
        else:
            continues = False
    return [line for record in records[-count:] for line in record]


def _launch(command: list[str], log_path: Path, environment: dict[str, str],
            stderr_to_console: bool = False) -> subprocess.Popen:
    output = open(log_path, "ab")
    stderr = None if stderr_to_console else subprocess.STDOUT
    # A session of its own: stopping it reaches every process below (vLLM engine cores, learner ranks). The
    # child dies with this process, should it be killed outright (`launched_environment`, `asyncrl.parent_death`).
    return subprocess.Popen(command, stdout=output, stderr=stderr, start_new_session=True, env=environment)


def _stop(process: subprocess.Popen, own_stop_s: float = 0.0) -> None:
    """Wait up to `own_stop_s` for `process` to end by itself, then SIGTERM its group, then SIGKILL what is left."""
    try:
        process.wait(own_stop_s)
    except subprocess.TimeoutExpired:
        pass
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(_STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # leftovers of the group, even when the leader has exited
    except ProcessLookupError:
        pass
    process.wait()
