"""Start the buffer service as a child process and wait until it serves.

The learner uses this when buffer.address is empty; roles never import each other, so the buffer
runs as its own process either way. Whoever starts a buffer passes the command line that runs the
`asyncrl buffer` command (`launch.commands.buffer.COMMAND_LINE`): `launch` owns the commands, this module
only adds the config and the directory to it. Readiness is the endpoint file the service writes after
binding. `BufferLaunch` keeps how the learner's buffer was started, so that a restart starts the same one.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from asyncrl.config import AsyncRLConfig, save_config
from asyncrl.net import split_tcp_endpoint
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


def start_buffer(command: Sequence[str], directory: str | Path, config_path: str | Path | None = None,
                 overrides: Sequence[str] = (), timeout_s: float = 30.0,
                 log_path: str | Path | None = None) -> BufferProcess:
    """Run `command` (the command line of `asyncrl buffer`) on `directory` and return once it accepts connections."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    endpoint = directory / ENDPOINT_FILE
    endpoint.unlink(missing_ok=True)
    config = ["--config", str(config_path)] if config_path is not None else []
    command = [*command, *config, f"buffer.dir={directory}", *overrides]
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
            process.wait()
            raise TimeoutError(f"buffer did not start serving within {timeout_s:.0f}s (see {log_path})")
        time.sleep(POLL_S)
    return BufferProcess(process, endpoint.read_text(), directory)


@dataclass(frozen=True)
class BufferLaunch:
    """How the learner starts its own buffer: the run's config on one directory, output appended to one log."""

    command: tuple[str, ...]  # the command line of `asyncrl buffer`, given by whoever started the learner
    directory: Path  # the buffer directory: log segments, commit, endpoint file
    config_path: Path  # the run's resolved config
    log_path: Path  # the child's output; each restart appends to it
    port: int = 0  # port to bind; 0 = the config's buffer.port
    timeout_s: float = 30.0  # longest wait for a start to serve

    def start(self) -> BufferProcess:
        overrides = [f"buffer.port={self.port}"] if self.port else []
        return start_buffer(self.command, self.directory, self.config_path, overrides, timeout_s=self.timeout_s,
                            log_path=self.log_path)

    def at(self, address: str) -> BufferLaunch:
        """This launch bound to the port of `address`: a restart serves where the clients look."""
        return replace(self, port=split_tcp_endpoint(address)[1])


def own_buffer_launch(config: AsyncRLConfig, run_dir: str | Path, command: Sequence[str], timeout_s: float = 30.0,
                      port: int = 0) -> BufferLaunch:
    """How to run a buffer for this run with `command` (the command line of `asyncrl buffer`): with the run's
    resolved config (saved in run_dir) on buffer.dir, or on <run_dir>/buffer, on `port` when buffer.port is 0
    (the port chosen by `port_to_bind`)."""
    run_dir = Path(run_dir)
    config_path = save_config(config, run_dir)
    directory = Path(config.buffer.dir) if config.buffer.dir else run_dir / BUFFER_SUBDIR
    return BufferLaunch(tuple(command), directory, config_path, run_dir / BUFFER_LOG, 0 if config.buffer.port else port,
                        timeout_s)
