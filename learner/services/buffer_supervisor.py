"""The learner's own buffer, kept running: when the `asyncrl buffer` child that rank 0 started dies, it is started
again on the same address and directory after the back-off of `asyncrl/restarts.py`, and the learner's requests
reach it there (its `RequestChannel` retries the one in flight against the restarted buffer). The log is durable
and every batch request carries the learner's position, so a restart loses no acknowledged trajectory and hands
out none twice. A buffer given by `buffer.address` is not the learner's child and is not watched.

A watcher thread owns the child: it starts every restart and lives until it has stopped the last one, because the
kernel kills a child when the thread that started it ends (`asyncrl/parent_death.py`)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Sequence

from asyncrl.buffer_process import BufferLaunch, own_buffer_launch
from asyncrl.config import AsyncRLConfig
from asyncrl.exit_codes import INTERRUPTED
from asyncrl.restarts import QuickDeaths

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the watcher looks at the buffer process
STOPPED_CODES = (0, INTERRUPTED, -signal.SIGTERM, -signal.SIGINT)  # a buffer that ended on a stop signal: not restarted


class BufferNotRestarted(RuntimeError):
    """The learner's own buffer exited and is not started again: it was stopped, or it kept dying
    (buffer.max_restarts)."""


def connect_or_supervise_buffer(config: AsyncRLConfig, run_dir: str | Path, command: Sequence[str],
                                port: int = 0) -> tuple[str, BufferSupervisor | None]:
    """The buffer address to use: buffer.address if set (not watched: it is not this learner's child), else that
    of a buffer started with `command` (the command line of `asyncrl buffer`) and kept running for this run (on
    `port` when buffer.port is 0). The caller stops it."""
    if config.buffer.address:
        return config.buffer.address, None
    launch = own_buffer_launch(config, run_dir, command, port=port)
    supervisor = BufferSupervisor(launch, QuickDeaths.of(config.rollout, config.buffer.max_restarts))
    return supervisor.address, supervisor


def exit_reason(code: int) -> str:
    """How a process ended, from its Popen return code (negative: the signal that killed it)."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def restart_delay(deaths: QuickDeaths, death: str, ran_s: float, log_path: Path) -> float:
    """Seconds to wait before starting the buffer again after `death` (what happened, e.g. "... was killed by
    SIGKILL"), `ran_s` after its start; BufferNotRestarted once buffer.max_restarts is used up."""
    delay = deaths.restart_delay(ran_s)
    if delay is None:
        raise BufferNotRestarted(f"{death} after {ran_s:.1f}s and is not restarted again: {deaths.describe()}, "
                                 f"buffer.max_restarts={deaths.max_restarts}; see {log_path}")
    log.warning("%s after %.1fs: restarting the buffer in %.1fs, attempt %d of %d (buffer.max_restarts; %s)",
                death, ran_s, delay, deaths.in_a_row, deaths.max_restarts, deaths.describe())
    return delay


class BufferSupervisor:
    """The learner's buffer child and the thread that restarts it. `restarts`, `restarting` and `check` are what
    the learner's buffer client asks while a request goes unanswered (`asyncrl.transport.RestartWatch`)."""

    def __init__(self, launch: BufferLaunch, deaths: QuickDeaths) -> None:
        self.buffer = launch.start()
        self.address = self.buffer.address
        self.launch = launch.at(self.address)  # a restart binds the port the first start chose
        self.deaths = deaths
        self.started_at = time.monotonic()
        self.exit_code: int | None = None  # the last buffer's, once stopped
        self._restarts = 0  # buffers started in place of one that died
        self._restarting = False  # a buffer died and its successor is not serving yet
        self._failure: BufferNotRestarted | None = None  # why no buffer will serve again
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="buffer-supervisor", daemon=True)
        self._watcher.start()

    def restarts(self) -> int:
        return self._restarts

    def restarting(self) -> bool:
        return self._restarting

    def check(self) -> None:
        """Raise BufferNotRestarted once the buffer has exited for good."""
        if self._failure is not None:
            raise self._failure

    def stop(self) -> int | None:
        """Stop the buffer (SIGTERM, then SIGKILL) and the watcher; the buffer's exit code."""
        self._stopping.set()
        self._watcher.join()
        return self.exit_code

    def _watch(self) -> None:
        try:
            while not self._stopping.wait(POLL_S):
                if (code := self.buffer.process.poll()) is not None and not self._replace(code):
                    return
        finally:
            self.exit_code = self.buffer.stop()

    def _replace(self, code: int) -> bool:
        """Start a buffer in place of the one that exited with `code`, after its back-off; False when none is
        started (it was stopped on purpose, buffer.max_restarts is used up, or the learner is stopping)."""
        death = f"the buffer on {self.address} (pid {self.buffer.process.pid}) {exit_reason(code)}"
        if code in STOPPED_CODES:
            self._failure = BufferNotRestarted(f"{death}: stopped by a signal, so not restarted; see {self.launch.log_path}")
            return False
        self._restarting = True
        try:
            return self._start_again(death)
        except BufferNotRestarted as error:
            log.error("%s", error)
            self._failure = error
            return False
        finally:
            self._restarting = False

    def _start_again(self, death: str) -> bool:
        """Back off, start; a start that fails counts as one more quick death."""
        while True:
            delay = restart_delay(self.deaths, death, time.monotonic() - self.started_at, self.launch.log_path)
            if self._stopping.wait(delay):
                return False
            self.started_at = time.monotonic()
            try:
                self.buffer = self.launch.start()
            except (RuntimeError, TimeoutError) as error:  # it exited, or did not serve in time, before serving
                death = f"the restarted buffer on {self.address} did not serve ({error})"
                continue
            self._restarts += 1
            log.info("restarted the buffer on %s (pid %d, restart %d of this run)", self.address,
                     self.buffer.process.pid, self._restarts)
            return True
