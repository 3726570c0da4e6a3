"""freeze_startup_heap: what is alive at the end of startup leaves the collector's passes, garbage does not
survive into the frozen set, what the role allocates later is still collected, and at exit the frozen objects
are collected too. exit_without_teardown: a process whose role ended normally skips the interpreter's teardown
but none of its later exit handlers, and keeps its exit status otherwise. keep_freed_memory: freed blocks are reused rather than returned to the kernel and faulted
in again."""

import gc
import platform
import subprocess
import sys
import weakref

import pytest

from asyncrl.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.partner: "Node | None" = None


def cycle() -> weakref.ref:
    """Two nodes referring to each other, otherwise unreferenced: only the collector frees them."""
    first, second = Node(), Node()
    first.partner, second.partner = second, first
    return weakref.ref(first)


@pytest.fixture
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test process is collected as usual


def test_objects_alive_at_startup_leave_the_collectors_passes(thawed):
    survivors = [[index] for index in range(1_000)]  # lists are tracked by the collector
    assert {id(item) for item in survivors} <= {id(obj) for obj in gc.get_objects()}

    frozen = freeze_startup_heap()

    # frozen objects freed since (by a thread an earlier test left running) leave the count; none can join it
    assert frozen >= gc.get_freeze_count() >= len(survivors)
    assert {id(item) for item in survivors}.isdisjoint(id(obj) for obj in gc.get_objects())


def test_startup_garbage_is_collected_before_freezing(thawed):
    garbage = cycle()
    gc.disable()  # so that only the helper's own collection can free the cycle
    try:
        freeze_startup_heap()
    finally:
        gc.enable()
    assert garbage() is None


def test_cycles_made_after_the_freeze_are_still_collected_automatically(thawed):
    freeze_startup_heap()
    later = cycle()
    assert later() is not None
    allocations = [[] for _ in range(3 * gc.get_threshold()[0])]  # enough to trigger a young collection
    assert later() is None
    del allocations


EXIT_PROBE = """
from asyncrl.heap import freeze_startup_heap
class Node:
    def __init__(self):
        self.partner = None
    def __del__(self):
        print("freed", flush=True)
first, second = Node(), Node()
first.partner, second.partner = second, first
freeze_startup_heap()
del first, second  # a frozen cycle turned garbage: only a collection that sees it can free it
"""


def test_a_frozen_cycle_is_freed_by_the_last_collection_at_exit():
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["freed", "freed"]


QUICK_EXIT_PROBE = """
import atexit, sys
from asyncrl.heap import ended_normally, exit_without_teardown
exit_without_teardown()
class Kept:
    def __del__(self):
        print("torn down", flush=True)  # the interpreter's teardown frees the module's objects
kept = Kept()
atexit.register(print, "handler ran", flush=True)  # a library's handler, registered after the arming
print("buffered")  # no flush: still in the stdout buffer when the process ends
if sys.argv[1] == "normal":
    ended_normally()
else:
    sys.exit(3)
"""


def quick_exit(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", QUICK_EXIT_PROBE, mode], capture_output=True, text=True, timeout=60)


def test_a_normal_end_runs_the_later_exit_handlers_then_skips_the_teardown():
    done = quick_exit("normal")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n") == ["buffered", "handler ran", ""]  # flushed; nothing freed one by one


def test_any_other_end_keeps_its_status_and_the_teardown():
    done = quick_exit("failed")
    assert done.returncode == 3
    assert done.stdout.split("\n") == ["buffered", "handler ran", "torn down", ""]


FAULT_PROBE = """
import ctypes, resource, sys
from asyncrl.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory(64 * 2**20)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, frames, turns = 110_000, 32, 50  # a turn's frames (a group is ~110 kB) are all freed after its write
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(turns):
    blocks = [libc.malloc(size) for _ in range(frames)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)  # glibc's default hands the arena's free top back to the kernel here
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    """Minor page faults of a fresh process that allocates, touches and frees 32 frames of 110 kB, 50 times."""
    done = subprocess.run([sys.executable, "-c", FAULT_PROBE, mode], capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_kept_freed_memory_is_reused_instead_of_faulted_in_again():
    pages_per_turn = 32 * 110_000 // 4096
    assert page_faults("default") > 25 * pages_per_turn  # the turns fault their frames' pages in again
    assert page_faults("keep") < 3 * pages_per_turn  # the first turn's pages serve every later one
