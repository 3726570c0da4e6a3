"""No orphans: each process a role starts asks the kernel (Linux `prctl(PR_SET_PDEATHSIG)`) to SIGKILL it when
its parent dies, so that a `kill -9` of `asyncrl run` or of the rollout supervisor takes down the whole tree
below it, one generation after the other (supervisor → server → vLLM engine core → its workers; learner →
ranks → buffer; server → reward workers).

SIGKILL rather than SIGTERM: the parent that would escalate a slow shutdown is gone, and a vLLM engine core
still starting ignores SIGTERM. Every role already survives a crash (the buffer acknowledges only what its
log holds; a learner resumes from its checkpoint; a server regenerates its unacknowledged prompts).

The kernel ties the signal to the *thread* that forked the child: every child here is started by a thread that
outlives it (a process's main thread; the reward pool's dispatcher, which stops its workers before it ends).
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
import sys

SPAWNED_FLAG = "--multiprocessing-fork"  # the last word of the command line of every process multiprocessing spawns
PARENT_PID_ENV = "ASYNCRL_DIE_WITH_PARENT"  # set by a launcher for the `asyncrl` command it starts: the launcher's pid
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_forking_pid = 0  # in a forked child: the pid of the process that forked it (`forked_children_die_with_parent`)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when `parent_pid`, its parent, dies; at once if that has happened already (the
    request only covers a parent still alive when it is made). Does nothing off Linux."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the request: this process is adopted already
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_spawning_parent() -> None:
    """In a process started by `multiprocessing` (spawn): die with the process that started it. Does nothing
    in a process that multiprocessing did not start (a test's own process, a user's script)."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        die_with_parent(parent.pid)


def die_with_spawner_from_the_start() -> None:
    """In a process that multiprocessing spawned below an asyncrl command: die with the process that spawned it,
    from before it unpickles and runs its target. Such a process imports the command's main module, `launch.cli`,
    before anything else, and that module calls this.

    Why so early: vLLM's engine core loads our plugin (`die_with_spawning_parent`) only after its handshake with
    the server that started it; a server stopped or killed before then left its engine core waiting for that
    handshake forever (ignoring SIGTERM), and with it the supervisor's multiprocessing resource tracker, which
    lives until the last process holding its pipe has gone. The parent is the process's parent now: if it died in
    the instant before this call, the later `die_with_spawning_parent` of the target (server, rank, reward worker,
    plugin) still notices."""
    if SPAWNED_FLAG in sys.orig_argv:
        die_with_parent(os.getppid())


def launched_environment() -> dict[str, str]:
    """The environment for an `asyncrl` command this process starts, asking that command to die with it."""
    return os.environ | {PARENT_PID_ENV: str(os.getpid())}


def die_with_launcher() -> None:
    """In an `asyncrl` command: die with the launcher that asked for it (`launched_environment`). The variable is
    removed, so that the processes this command starts in turn do not take its launcher for their own."""
    parent_pid = os.environ.pop(PARENT_PID_ENV, None)
    if parent_pid is not None:
        die_with_parent(int(parent_pid))


@functools.cache
def forked_children_die_with_parent() -> None:
    """Every process forked from this one from now on (and from those, in turn) dies with the process that forked
    it. A process that multiprocessing forks runs no code of ours before its target, unlike a spawned one
    (`die_with_spawner_from_the_start`), and vLLM's engine core loads our plugin only in a process that has not
    loaded it yet: a forked core has, from its parent. Once per process (cached)."""
    os.register_at_fork(before=_remember_forking_process, after_in_child=_die_with_forking_process)


def _remember_forking_process() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_forking_process() -> None:
    die_with_parent(_forking_pid)  # the child's copy of `_forking_pid`: its own parent, even two forks down
