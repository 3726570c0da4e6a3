"""A detached watchdog that stops a role's process group once the Ray actor that owns it is gone.

Ray kills an actor's direct children when the actor exits, but not their children (a vLLM engine core,
reward workers), and nothing at all when the actor process is SIGKILLed. This watchdog forks away from
the actor (so that cleanup does not reach it), waits until the actor or the group is gone, then sends
the group SIGTERM and, after a grace period, SIGKILL.

    python -m launch.ray_cluster.reaper OWNER_PID GROUP_ID GRACE_S
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.5  # how often the owner and the group are checked
_ZOMBIE = "Z"  # /proc state of an exited process not yet reaped by its parent


def process_alive(pid: int) -> bool:
    """True while `pid` runs (an exited process waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != _ZOMBIE


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(group: int, grace_s: float) -> None:
    """SIGTERM to every process of the group, then SIGKILL to whatever is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and group_alive(group):
            time.sleep(POLL_S)


def watch(owner: int, group: int, grace_s: float) -> None:
    while process_alive(owner) and group_alive(group):
        time.sleep(POLL_S)
    if group_alive(group):
        stop_group(group, grace_s)


def main(argv: list[str]) -> None:
    owner, group, grace_s = int(argv[0]), int(argv[1]), float(argv[2])
    if os.fork():  # the parent returns at once; the orphaned child is no longer the actor's child
        os._exit(0)
    watch(owner, group, grace_s)


if __name__ == "__main__":
    main(sys.argv[1:])
