"""Heap settings of long-running roles: startup objects out of the collector's passes; freed memory kept.

Freezing. A process that imported torch, transformers or vLLM holds several hundred thousand objects that live
as long as it does. CPython's full (generation 2) collection walks every one of them, and the
process's loop stands still meanwhile: ~250 ms in a rollout server on the 2-core dev box, ~140 ms in
the learner, ~13 ms in the buffer (docs/history/benchmarks-2026-11.md, garbage-collector pauses). Freezing moves the objects alive at the end of
startup into a permanent generation that collections skip, so later full collections walk only what
the role allocated since. Frozen objects are still freed by reference counting when their last
reference goes; only reference cycles among them would outlive their use, and startup leaves few;
they are thawed at exit, for the interpreter's last collection.

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

log = logging.getLogger(__name__)

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
