"""One buffer process per buffer directory: an exclusive lock on `<dir>/lock` for the process's life.

A restarted buffer can start while its killed predecessor is still shutting down (the Ray launcher
restarts the buffer once its actor is gone, and the actor goes before its role process does). Two
processes must never recover and append to one log, so the new one waits for the old one to let go.
The lock is flock(2): the kernel drops it when the holder exits, however it exits (kill -9 included).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import TracebackType

from asyncrl.file_lock import FileLock

log = logging.getLogger(__name__)

LOCK_FILE = "lock"


class DirectoryLocked(RuntimeError):
    """Another process held the buffer directory for longer than the wait allowed."""


class DirectoryLock:
    def __init__(self, directory: Path, timeout_s: float) -> None:
        """Take the lock, waiting up to `timeout_s` for another holder to exit (DirectoryLocked if it does not)."""
        self._lock = FileLock(directory / LOCK_FILE)
        self.path = self._lock.path

        def waiting(holder: str) -> None:
            log.warning("buffer directory %s is held by %s; waiting for it to exit", directory, holder)

        if not self._lock.take(timeout_s, waiting):
            raise DirectoryLocked(f"buffer directory {directory} is still held by {self._lock.holder()} after "
                                  f"{timeout_s:.0f}s (buffer.lock_timeout_s); one buffer per directory")

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.release()
