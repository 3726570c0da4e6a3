"""Heap settings of long-running roles: startup objects out of the collector's passes; freed memory kept.

Freezing. A process that imported torch, transformers or vLLM holds several hundred thousand objects that live
as long as it does. CPython's full (generation 2) collection walks every one of them, and the
process's loop stands still meanwhile: ~250 ms in a rollout server on the 2-core dev box, ~140 ms in
the learner, ~13 ms in the buffer (docs/history/benchmarks-2026-11.md, garbage-collector pauses). Freezing moves the objects alive at the end of
startup into a permanent generation that collections skip, so later full collections walk only what
the role allocated since. Frozen objects are still freed by reference counting when their last
reference goes; only reference cycles among them would outlive their use, and startup leaves few;
they are thawed at exit, for the interpreter's last collection.

Ending without teardown. After its exit handlers, the interpreter frees its modules and then every object one
by one: 3-4 s of CPU in a rollout server or a learner rank on the dev box, after the role's work is done and its
files, sockets and children are closed. A role that ended normally skips that part (`exit_without_teardown`).

Keeping freed memory. glibc's malloc hands the free top of an arena back to the kernel once more than
128 KB of it are free, and serves blocks over 128 KB (at first) with a fresh mmap each. A process that
receives, writes and frees 100 kB frames at high rate (the buffer) then faults the same pages in again
for every frame: 15 page faults per group of 8 trajectories in ZeroMQ's I/O thread at 50,000
trajectories/s, page faults being dear in a VM. Raising both thresholds lets freed frames be reused.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
from typing import NoReturn

log = logging.getLogger(__name__)

_ended_normally = False  # set by the role once its work is done and closed (`ended_normally`)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (glibc's malloc.h)
GLIBC_MAX_MMAP_THRESHOLD = 4 * 2**20 * ctypes.sizeof(ctypes.c_long)  # the largest M_MMAP_THRESHOLD glibc accepts


def freeze_startup_heap() -> int:
    """Collect what startup left as garbage, then freeze every object alive now; return how many are frozen.

    Call once per process, when the role has built its long-lived state and is about to serve. At exit the
    objects are thawed again, so that the interpreter's last collection frees the cycles among them:
    frozen, they would outlive it, and extension modules that count their objects at teardown (triton's
    bindings, imported with vLLM) print every survivor as a leak."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    log.debug("froze %d startup objects: full collections no longer walk them", frozen)
    return frozen


def keep_freed_memory(keep_bytes: int) -> bool:
    """Let malloc keep up to `keep_bytes` of freed memory per arena, and serve blocks up to that size (at most
    glibc's 32 MiB) from its arenas, instead of returning memory to the kernel on every free.

    Returns False, changing nothing, where the C library is not glibc. Call once, before serving."""
    libc = _glibc()
    if libc is None:
        log.debug("not glibc: freed memory is returned to the kernel as the C library decides")
        return False
    # Setting either threshold stops glibc from adapting the mmap one itself, so both are set.
    mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, min(keep_bytes, GLIBC_MAX_MMAP_THRESHOLD))
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, keep_bytes)
    if not (mmap_ok and trim_ok):
        raise ValueError(f"glibc refused to keep {keep_bytes} bytes of freed memory")
    log.debug("malloc keeps up to %d bytes of freed memory per arena", keep_bytes)
    return True


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it has mallopt and gnu_get_libc_version), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def exit_without_teardown() -> None:
    """Arm the quick end: once the exit handlers registered after this call have run, a process whose role said
    `ended_normally` ends with status 0 at once, its logs and standard streams flushed, skipping the interpreter's
    teardown of its modules and objects. Call first thing in a process (`launch.cli` does, so every `asyncrl`
    command and every process spawned below one is armed); exit handlers run newest first, so those of the
    libraries imported later (vLLM's, torch's, wandb's, temporary directories') all still run."""
    atexit.register(_end_at_once_if_normal)


def ended_normally() -> None:
    """This process's role finished its work and closed what it holds: its exit may skip the teardown (a no-op in
    a process that `exit_without_teardown` did not arm)."""
    global _ended_normally
    _ended_normally = True


def leave_now(code: int) -> NoReturn:
    """End this process with exit status `code` at once, its logs and standard streams flushed: no exit handlers
    run after this, and no teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _end_at_once_if_normal() -> None:
    if _ended_normally:
        leave_now(0)
