"""One buffer process per buffer directory: an exclusive lock on `<dir>/lock` for the process's life.

A restarted buffer can start while its killed predecessor is still shutting down (the Ray launcher
restarts the buffer once its actor is gone, and the actor goes before its role process does). Two
processes must never recover and append to one log, so the new one waits for the old one to let go.
The lock is flock(2): the kernel drops it when the holder exits, however it exits (kill -9 included).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

LOCK_FILE = "lock"
POLL_S = 0.1  # how often a waiting buffer tries the lock again


class DirectoryLocked(RuntimeError):
    """Another process held the buffer directory for longer than the wait allowed."""


class DirectoryLock:
    def __init__(self, directory: Path, timeout_s: float) -> None:
        """Take the lock, waiting up to `timeout_s` for another holder to exit (DirectoryLocked if it does not)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout_s
        waiting = False
        while not self._try_lock():
            holder = self.path.read_text().strip() or "unknown process"
            if time.monotonic() >= deadline:
                os.close(self._fd)
                raise DirectoryLocked(f"buffer directory {directory} is still held by {holder} after "
                                      f"{timeout_s:.0f}s (buffer.lock_timeout_s); one buffer per directory")
            if not waiting:
                log.warning("buffer directory %s is held by %s; waiting for it to exit", directory, holder)
                waiting = True
            time.sleep(POLL_S)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())

    def _try_lock(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        os.close(self._fd)  # closing the only descriptor drops the lock

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.release()
