"""An exclusive lock on a file, taken with a bounded wait: flock(2), which the kernel drops when its holder exits,
however it exits (kill -9 included), so a dead holder never leaves it taken. The holder writes who it is into the
file, for the message of whoever waits for it.

flock belongs to the open file, not to the process: a child forked while the lock is held (vLLM forks its engine
core) shares it, and closing the holder's descriptor alone would leave it taken for as long as that child lives.
`release` unlocks before it closes, which lets go for the children too."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Callable

POLL_S = 0.1  # how often a waiting process tries the lock again


class FileLock:
    """The lock on `path` (the file is made where missing); `take` it, `release` it."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def take(self, timeout_s: float, on_wait: Callable[[str], None], holder: str = "") -> bool:
        """Take the lock, waiting up to `timeout_s` for its holder to let go; `on_wait(holder)` is told once, when
        it must wait, who holds it. False, the file closed, where it is still held at the deadline. Once taken, the
        file names this process (and `holder`, what it holds the lock for)."""
        deadline = time.monotonic() + timeout_s
        waiting = False
        while not self._try():
            if time.monotonic() >= deadline:
                os.close(self._fd)
                return False
            if not waiting:
                on_wait(self.holder())
                waiting = True
            time.sleep(POLL_S)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"pid {os.getpid()} on {socket.gethostname()}{f' ({holder})' if holder else ''}\n".encode())
        return True

    def holder(self) -> str:
        """Who holds the lock, as its holder wrote it ("unknown process" before it did)."""
        return self.path.read_text().strip() or "unknown process"

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)  # for every process sharing the open file: forked children too
        os.close(self._fd)

    def _try(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
