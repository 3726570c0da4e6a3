"""One buffer process per directory: a second holder waits for the first, and fails clearly if it stays."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from buffer.dir_lock import LOCK_FILE, DirectoryLock, DirectoryLocked
from waiting import wait_until

HOLD = "import sys, time; from pathlib import Path; from buffer.dir_lock import DirectoryLock; " \
       "DirectoryLock(Path(sys.argv[1]), 0); print('held', flush=True); time.sleep(600)"  # holds it until killed
WAIT_S = 60.0  # generous: the waiting side returns as soon as the holder lets go
WAITING = "waiting for it to exit"  # what a holder that has to wait logs, once


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    with DirectoryLock(tmp_path, 0):
        with pytest.raises(DirectoryLocked, match=rf"still held by pid {os.getpid()} on .*buffer.lock_timeout_s"):
            DirectoryLock(tmp_path, 0)
    DirectoryLock(tmp_path, 0).release()  # free again once released
    assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")


def test_a_waiting_holder_gets_the_lock_when_the_first_releases_it(tmp_path, caplog):
    first = DirectoryLock(tmp_path, 0)

    def exit_once_the_successor_waits() -> None:  # the predecessor exits while its successor waits
        wait_until(lambda: WAITING in caplog.text, WAIT_S, "the second holder waiting")
        first.release()

    predecessor = threading.Thread(target=exit_once_the_successor_waits)
    predecessor.start()
    DirectoryLock(tmp_path, WAIT_S).release()
    predecessor.join()
    assert caplog.text.count(WAITING) == 1
    assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")


def test_a_killed_holder_frees_the_directory(tmp_path):
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryLocked, match=f"pid {holder.pid} "):
            DirectoryLock(tmp_path, 0)
    finally:
        holder.kill()
        holder.wait()
    DirectoryLock(tmp_path, WAIT_S).release()  # kill -9 drops the lock with the process
