"""Start the buffer service as a child process (`asyncrl buffer`) and wait until it serves.

The learner uses this when buffer.address is empty; roles never import each other, so the buffer
runs as its own process either way. Readiness is the endpoint file the service writes after binding.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from asyncrl.config import AsyncRLConfig, save_config
from asyncrl.parent_death import launched_environment

BUFFER_SUBDIR = "buffer"  # the buffer's directory inside a run directory when buffer.dir is empty
BUFFER_LOG = "buffer.log"  # the child's output, in the run directory
ENDPOINT_FILE = "endpoint"  # the service writes its bound tcp:// address here once it serves
POLL_S = 0.05  # how often the endpoint file is looked for


@dataclass
class BufferProcess:
    process: subprocess.Popen
    address: str  # tcp:// endpoint the service bound
    directory: Path  # its buffer directory

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait, then SIGKILL if it has not exited; return the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no clean shutdown."""
        self.process.kill()
        self.process.wait()


def start_buffer(directory: str | Path, config_path: str | Path | None = None, overrides: Sequence[str] = (),
                 timeout_s: float = 30.0, log_path: str | Path | None = None) -> BufferProcess:
    """Run `asyncrl buffer` on `directory` and return once it accepts connections."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    endpoint = directory / ENDPOINT_FILE
    endpoint.unlink(missing_ok=True)
    command = [sys.executable, "-m", "launch.cli", "buffer", f"buffer.dir={directory}", *overrides]
    if config_path is not None:
        command[4:4] = ["--config", str(config_path)]
    environment = launched_environment()  # the buffer dies with the process that started it
    if log_path is None:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=environment)
    else:
        with open(log_path, "ab") as output:  # the child keeps its own handle
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment)
    deadline = time.monotonic() + timeout_s
    while not endpoint.exists():
        if process.poll() is not None:
            raise RuntimeError(f"buffer process exited with code {process.returncode} before serving (see {log_path})")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"buffer did not start serving within {timeout_s:.0f}s (see {log_path})")
        time.sleep(POLL_S)
    return BufferProcess(process, endpoint.read_text(), directory)


def connect_or_start_buffer(config: AsyncRLConfig, run_dir: str | Path, timeout_s: float = 30.0,
                            port: int = 0) -> tuple[str, BufferProcess | None]:
    """The buffer address to use: buffer.address if set, else that of a buffer started for this run.

    The started buffer runs with this run's resolved config (saved in run_dir) on buffer.dir, or on
    <run_dir>/buffer, on `port` when buffer.port is 0 (the port chosen by `port_to_bind`); the caller stops
    it (BufferProcess.stop) when the run ends."""
    if config.buffer.address:
        return config.buffer.address, None
    run_dir = Path(run_dir)
    config_path = save_config(config, run_dir)
    directory = Path(config.buffer.dir) if config.buffer.dir else run_dir / BUFFER_SUBDIR
    overrides = [f"buffer.port={port}"] if port and not config.buffer.port else []
    process = start_buffer(directory, config_path, overrides, timeout_s=timeout_s, log_path=run_dir / BUFFER_LOG)
    return process.address, process
