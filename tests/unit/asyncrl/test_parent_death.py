"""A process started by a role dies when the role is killed outright: through `multiprocessing` (servers, ranks,
reward workers, vLLM's engine core; below an asyncrl command from its very start), forked by one (a server's engine
core on CPU) and as an `asyncrl` command a launcher starts (learner, rollout, buffer)."""

import os
import signal
import subprocess
import sys

import psutil
import pytest

from waiting import wait_until

pytestmark = pytest.mark.timeout(60)

DEATH_BOUND_S = 20  # the kernel signals at once; slack for a loaded box
POLL_S = 0.05

# The middle process: starts a grandchild that asks to die with it, prints the grandchild's pid, then waits to be
# killed. argv[1] says how the grandchild is started; a forked one asks nothing itself (as vLLM's engine core forked
# by a server: our plugin is loaded in it already), the middle process asked for every child it forks.
MIDDLE = """
import multiprocessing, subprocess, sys, time
from asyncrl.parent_death import die_with_spawning_parent, forked_children_die_with_parent, launched_environment

def grandchild():
    die_with_spawning_parent()
    time.sleep(600)  # lives until its parent's death ends it

if __name__ == "__main__":
    if sys.argv[1] in ("spawn", "fork"):
        if sys.argv[1] == "fork":
            forked_children_die_with_parent()
        target = grandchild if sys.argv[1] == "spawn" else time.sleep
        child = multiprocessing.get_context(sys.argv[1]).Process(target=target, args=() if target is grandchild else (600,))
        child.start()
        pid = child.pid
    else:
        code = "from asyncrl.parent_death import die_with_launcher; import time; die_with_launcher(); time.sleep(600)"
        pid = subprocess.Popen([sys.executable, "-c", code], env=launched_environment()).pid
    print(pid, flush=True)
    time.sleep(600)  # lives until the test kills it
"""

# The middle process of an asyncrl command: its main module imports launch.cli, as `asyncrl` and `python -m
# launch.cli` do. Its grandchild's target never asks to die with its parent (vLLM's engine core before its
# handshake with the server does not get to); it says that it runs, then waits.
MIDDLE_OF_A_COMMAND = """
import multiprocessing, time
import launch.cli

def waits_without_asking():
    print("running", flush=True)
    time.sleep(600)  # lives until its parent's death ends it

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=waits_without_asking)
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)  # lives until the test kills it
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("started_by", ["spawn", "fork", "command"])
def test_a_child_dies_when_its_parent_is_killed_outright(tmp_path, started_by):
    script = tmp_path / "middle.py"
    script.write_text(MIDDLE)
    middle = subprocess.Popen([sys.executable, str(script), started_by], stdout=subprocess.PIPE, text=True,
                              env=os.environ.copy())
    grandchild = int(middle.stdout.readline())
    kill_and_expect_the_grandchild_to_follow(middle, grandchild)  # before or after it asked: it dies either way


def test_a_process_spawned_below_an_asyncrl_command_dies_with_its_parent_before_its_target_asks(tmp_path):
    script = tmp_path / "middle.py"
    script.write_text(MIDDLE_OF_A_COMMAND)
    middle = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    grandchild = int(middle.stdout.readline())
    started = middle.stdout.readline().strip()  # its target runs: the main module's import is behind it
    kill_and_expect_the_grandchild_to_follow(middle, grandchild)
    assert started == "running"


def kill_and_expect_the_grandchild_to_follow(middle: subprocess.Popen, grandchild: int) -> None:
    """Kill `middle` outright; its child `grandchild` must die with it (both are killed if a check fails)."""
    try:
        middle.kill()
        middle.wait()
        wait_until(lambda: gone(grandchild), DEATH_BOUND_S, f"grandchild {grandchild} to die with its parent",
                   poll_s=POLL_S)
    finally:
        for pid in (grandchild, middle.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_child_whose_parent_died_before_it_asked_dies_at_once():
    code = "import os; from asyncrl.parent_death import die_with_parent; die_with_parent(os.getppid() + 1); print('alive')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == -signal.SIGKILL
    assert "alive" not in done.stdout


def test_the_launchers_pid_is_not_passed_on_to_the_commands_own_children():
    from asyncrl.parent_death import PARENT_PID_ENV, launched_environment

    code = f"import os; from asyncrl.parent_death import die_with_launcher; die_with_launcher(); print('{PARENT_PID_ENV}' in os.environ)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=launched_environment())
    assert done.stdout.strip() == "False", done.stderr
