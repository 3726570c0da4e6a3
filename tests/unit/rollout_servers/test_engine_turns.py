"""Engines sharing a GPU start one at a time; engines on other GPUs do not wait; a wait is bounded and named."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from rollout_servers.engine_turns import EngineStartTurnTimeout, engine_start_turn
from waiting import wait_until

WAIT_S = 60.0  # generous: a waiting start goes on as soon as the turn is free
WAITING = "waits for its turn to start on GPU"  # what a start that has to wait logs, once


class Start(threading.Thread):
    """One engine's start on `gpus` in a thread: takes the turns, says so, holds them until `finish` is set."""

    def __init__(self, gpus: list[int], turns_dir, name: str, timeout_s: float = WAIT_S) -> None:
        super().__init__(daemon=True)
        self.gpus, self.turns_dir, self.label, self.timeout_s = gpus, turns_dir, name, timeout_s
        self.started, self.finish = threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with engine_start_turn(self.gpus, self.timeout_s, self.label, self.turns_dir):
                self.started.set()
                self.finish.wait(WAIT_S)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            self.error = error


def test_a_second_engine_on_the_gpu_starts_only_once_the_first_has_started(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rollout_servers.engine_turns")
    first, second = Start([0], tmp_path, "server-0"), Start([0], tmp_path, "server-1")
    first.start()
    assert first.started.wait(WAIT_S)
    second.start()
    wait_until(lambda: WAITING in caplog.text, WAIT_S, "the second start waiting")
    assert not second.started.is_set(), "it started while the first engine was starting on its GPU"
    assert "server-1 waits for its turn to start on GPU 0" in caplog.text and "server-0 starting" in caplog.text
    first.finish.set()
    assert second.started.wait(WAIT_S)
    second.finish.set()
    second.join()
    assert caplog.text.count(WAITING) == 1 and second.error is None
    assert (tmp_path / "gpu0.lock").read_text().startswith(f"pid {os.getpid()} ")


def open_descriptor_of(path: Path) -> int:
    """This process's descriptor open on `path` (the one a held turn's lock keeps)."""
    fds = [int(fd) for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == str(path)]
    assert len(fds) == 1, f"descriptors on {path}: {fds}"
    return fds[0]


def test_a_turn_is_let_go_when_the_start_ends_though_a_process_it_forked_lives_on(tmp_path):
    # vLLM forks its engine core while the turn is held: the child shares the lock's open file (modelled here by a
    # child that inherits the descriptor), and lives as long as the engine. Seen on an H100: the second server of a
    # GPU waited for the first one's whole job, past its 300 s, while the learner waited for it to join.
    with engine_start_turn([0], WAIT_S, "server-0", tmp_path):
        fd = open_descriptor_of(tmp_path / "gpu0.lock")
        engine_core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=[fd])
    try:
        with engine_start_turn([0], 0.0, "server-1", tmp_path):
            pass  # taken at once: the first start let go of GPU 0's turn, its engine core still running
        assert engine_core.poll() is None, "the engine core ended: the test no longer shows what it is for"
    finally:
        engine_core.kill()
        engine_core.wait()


@contextlib.contextmanager
def starting(gpus: list[int], turns_dir, name: str, timeout_s: float = WAIT_S) -> Iterator[Start]:
    """An engine's start on `gpus` holding their turns (in a thread) while the block runs."""
    start = Start(gpus, turns_dir, name, timeout_s)
    start.start()
    try:
        wait_until(lambda: start.started.is_set() or not start.is_alive(), WAIT_S, f"{name} taking its turns")
        assert start.started.is_set(), f"{name} did not get its turns: {start.error}"
        yield start
    finally:
        start.finish.set()
        start.join()


def test_engines_on_other_gpus_start_at_once(tmp_path):
    with starting([0], tmp_path, "server-0"), starting([1], tmp_path, "server-1", timeout_s=0.0):
        pass  # an engine on GPU 1 started while one was starting on GPU 0, without a wait


def test_a_start_held_past_the_wait_fails_naming_the_gpu_the_holder_and_the_key(tmp_path):
    with starting([3], tmp_path, "server-0"):
        with pytest.raises(EngineStartTurnTimeout,
                           match=r"server-1: another engine \(pid \d+ on .* \(server-0 starting\)\) was still starting "
                                 r"on GPU 3 after 0s \(rollout.connect_timeout_s\)"):
            with engine_start_turn([3], 0.2, "server-1", tmp_path):
                pytest.fail("the block ran without the GPU's turn")


def test_a_server_of_several_gpus_lets_go_of_those_it_took_when_one_is_held(tmp_path):
    with starting([2], tmp_path, "server-0"):
        with pytest.raises(EngineStartTurnTimeout, match="GPU 2"):
            with engine_start_turn([2, 1], 0.2, "server-1", tmp_path):  # GPU 1 is taken first (ids in order), then 2
                pass
        with starting([1], tmp_path, "server-2", timeout_s=0.0):
            pass  # GPU 1's turn was not kept by the start that failed


def test_without_gpus_there_is_no_turn_to_take(tmp_path):
    with engine_start_turn([], 0.0, "server-0", tmp_path / "turns"):
        with engine_start_turn([], 0.0, "server-1", tmp_path / "turns"):
            pass
    assert not (tmp_path / "turns").exists()
