"""CUDA MPS for a job whose learner and rollout servers share a GPU (`run.mps`, read by `asyncrl run`).

Without MPS the CUDA contexts of two processes on one GPU share it in time slices: while the learner's kernels run, the
engine's decode steps wait, though a decode step alone uses a small part of the GPU's compute. Under MPS the processes'
kernels run at once, as one context's would. `asyncrl run` starts a control daemon of the job's own for the job's
lifetime (`nvidia-cuda-mps-control -f`, its pipe in a fresh directory, its log in RUN_DIR/logs/mps) and gives its roles
the variables that make their CUDA contexts its clients; processes without them, other jobs included, are not touched.
The daemon sees every GPU, as the roles' CUDA_VISIBLE_DEVICES (physical ids) expect: a client's ids are read against the
devices its server sees. While the job runs, the daemon is asked whether an MPS server serves its roles (it starts one
for the first client): the first seen is logged and written to RUN_DIR/logs/mps/serving, and a job that never had one
says so at its end (its roles shared the GPU in time slices). At the job's end the daemon is told to quit; it dies with
`asyncrl run` should that be killed outright (an MPS server it had started may then stay until its clients are gone).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.config import AsyncRLConfig, ConfigError
from asyncrl.gpu_ids import VISIBLE_DEVICES
from asyncrl.parent_death import die_with_parent
from asyncrl.placement import Plan

CONTROL = "nvidia-cuda-mps-control"  # NVIDIA's MPS control program, installed with the driver's compute utilities
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
READY_FILE = "control"  # the daemon's socket in its pipe directory: present once it takes clients
LOG_DIR = Path("logs") / "mps"  # in the run directory: the daemon's logs (CUDA_MPS_LOG_DIRECTORY)
SERVING_FILE = "serving"  # in LOG_DIR: the pids of the MPS servers seen serving the job's roles, once one is
START_TIMEOUT_S = 10.0  # longest wait for the daemon to take clients
STOP_TIMEOUT_S = 10.0  # longest wait for it to quit when told, before it is killed
ASK_EVERY_S = 15.0  # how often a running job asks the daemon whether a server serves its roles, until one does
ASK_TIMEOUT_S = 10.0  # longest wait for the daemon's answer
POLL_S = 0.05  # how often the start looks for the socket

AUTO, ON = "auto", "on"  # run.mps values that start a daemon


class MpsError(ConfigError):
    """run.mps=on and the job cannot have MPS: the reason names the key."""


@dataclass
class MpsDaemon:
    """A running control daemon of this job's own."""

    process: subprocess.Popen
    pipe_dir: Path  # its socket's directory, made for it (a short path: a socket's path is at most 107 bytes)
    log_dir: Path
    serving: list[str] = field(default_factory=list)  # the MPS servers' pids seen serving the roles (none yet: [])
    asked_at: float = -math.inf  # time.monotonic() of the last question

    def environment(self) -> dict[str, str]:
        """The variables that make a process's CUDA contexts this daemon's clients."""
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def follow(self, log: logging.Logger, final: bool = False) -> None:
        """Until an MPS server is seen serving the roles, ask the daemon every ASK_EVERY_S (`final`: now): the first
        seen is logged and written to SERVING_FILE; at the `final` question, none seen is a warning."""
        if self.serving or (not final and time.monotonic() - self.asked_at < ASK_EVERY_S):
            return
        self.asked_at = time.monotonic()
        try:
            self.serving = self._ask("get_server_list", ASK_TIMEOUT_S).split()
        except (subprocess.TimeoutExpired, OSError) as error:
            log.warning("CUDA MPS: the daemon did not answer whether a server runs (%s)", error)
        if self.serving:
            (self.log_dir / SERVING_FILE).write_text("\n".join(self.serving) + "\n")
            log.info("CUDA MPS: server pid %s serves the job's roles: their kernels run at once", ", ".join(self.serving))
        elif final:
            log.warning("CUDA MPS: no MPS server served the job's roles: they shared the GPU in time slices (see %s)",
                        self.log_dir)

    def _ask(self, command: str, timeout_s: float) -> str:
        """The daemon's answer to a control command (subprocess.TimeoutExpired after `timeout_s`)."""
        return subprocess.run([CONTROL], input=command + "\n", text=True, env=os.environ | self.environment(),
                              capture_output=True, timeout=timeout_s).stdout

    def stop(self) -> None:
        """Tell the daemon to quit (its server with it), wait a bounded time, then kill it; remove its pipe directory."""
        if self.process.poll() is None:
            try:
                self._ask("quit", STOP_TIMEOUT_S)
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.pipe_dir, ignore_errors=True)


def wanted(config: AsyncRLConfig, plan: Plan | None) -> bool:
    """Whether the job should run under MPS: on, or auto where an async job's learner and every server share its one
    GPU (weights passed by CUDA IPC). Several GPUs are left to `on`: NCCL between MPS clients is untried here."""
    setting = config.run.mps
    if setting == ON and plan is None:
        raise MpsError("run.mps=on: no GPU is visible, and MPS shares a GPU (set run.mps=off or auto on a CPU)")
    one_shared_gpu = plan is not None and len(plan.learner) == 1 and all(gpus == plan.learner for gpus in plan.servers)
    return setting == ON or (setting == AUTO and one_shared_gpu and config.learner.mode == "async")


def start_mps(config: AsyncRLConfig, plan: Plan | None, run_dir: Path, log: logging.Logger) -> MpsDaemon | None:
    """The job's MPS daemon when `run.mps` asks for one and it starts; None otherwise. With run.mps=on, a daemon that
    cannot start is an MpsError naming why; with auto, a warning, and the roles share the GPU in time slices."""
    if not wanted(config, plan):
        return None
    try:
        daemon = _start(run_dir / LOG_DIR)
    except MpsError as error:
        if config.run.mps == ON:
            raise
        log.warning("%s; the roles share the GPU in time slices (run.mps=auto)", error)
        return None
    log.info("CUDA MPS: control daemon pid %d (pipe %s, log %s): the roles on a shared GPU run their kernels at once",
             daemon.process.pid, daemon.pipe_dir, daemon.log_dir)
    return daemon


def _start(log_dir: Path) -> MpsDaemon:
    control = shutil.which(CONTROL)
    if control is None:
        raise MpsError(f"run.mps: {CONTROL} is not installed here (it comes with NVIDIA's driver utilities)")
    log_dir = log_dir.absolute()  # the roles read it from their own working directory
    log_dir.mkdir(parents=True, exist_ok=True)
    pipe_dir = Path(tempfile.mkdtemp(prefix="asyncrl-mps-"))
    environment = {key: value for key, value in os.environ.items() if key != VISIBLE_DEVICES}
    environment |= {PIPE_ENV: str(pipe_dir), LOG_ENV: str(log_dir)}
    launcher = os.getpid()
    with open(log_dir / "control.out", "ab") as output:
        process = subprocess.Popen([control, "-f"], stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                   env=environment, preexec_fn=lambda: die_with_parent(launcher))
    daemon = MpsDaemon(process, pipe_dir, log_dir)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (pipe_dir / READY_FILE).exists():
        if process.poll() is not None or time.monotonic() > deadline:
            state = (f"exited with {process.returncode}" if process.returncode is not None
                     else f"took no clients within {START_TIMEOUT_S:g}s")
            daemon.stop()
            raise MpsError(f"run.mps: {CONTROL} {state} (see {log_dir})")
        time.sleep(POLL_S)
    return daemon
