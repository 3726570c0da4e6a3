"""One reaper at a time for the child processes that `multiprocessing` starts in the test process.

CPython's `Popen.poll` reaps a child with `waitpid` and records its exit code a statement later, with no lock
(python/cpython#130895). The test process has threads: the real jobs run beside the tests (tests/integration/
conftest.py), and every `Process.start()` sweeps all of the process's children with a non-blocking poll
(`multiprocessing.process._cleanup`). When such a sweep reaps a child that a test is joining, the test's own wait gets
ECHILD and `join()` returns with `exitcode` None: `torch.multiprocessing.spawn` then fails with "'<' not supported
between instances of 'NoneType' and 'int'" (seen once in the FSDP test, a real job starting its ranks meanwhile)."""

from __future__ import annotations

import os
import threading
from multiprocessing import popen_fork

_REAPING = threading.Lock()  # held while a child is reaped and its code recorded: the two are one step


def one_reaper_at_a_time() -> None:
    """Patch the poll of fork and spawn children (spawn's Popen inherits fork's) so that reaping and recording the
    code happen under one lock, and a blocking poll waits for the child's end outside it, without reaping."""
    unsafe_poll = popen_fork.Popen.poll
    if getattr(unsafe_poll, "one_reaper", False):
        return

    def poll(self: popen_fork.Popen, flag: int = os.WNOHANG) -> int | None:
        if flag == 0 and self.returncode is None:
            try:  # wait until it has ended, leaving it to be reaped under the lock
                os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:  # another thread reaped it, and recorded its code under the lock
                pass
        with _REAPING:
            return unsafe_poll(self, os.WNOHANG)

    poll.one_reaper = True  # type: ignore[attr-defined]
    popen_fork.Popen.poll = poll  # type: ignore[method-assign]
