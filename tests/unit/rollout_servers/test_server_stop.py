"""A rollout server stopped while its vLLM engine starts never serves. vLLM waits for its engine core's handshake
inside `zmq_socket_ctx`, which catches the KeyboardInterrupt of the stop and lets the start go on to a running
engine; the server acts on the stop once the start is over: it shuts that engine down and ends as stopped, before
it joins weight sync or asks the buffer for work. A start that fails because of the stop (a Ctrl-C reaches the
engine core too) ends as stopped as well. The engine start is stood in for; the context that swallows the
interrupt is vLLM's own, and the stop is handled as the server's process handles it (`interrupt_once`). A server on
a GPU starts its engine in that GPU's start turn (`rollout_servers.engine_turns`); a stop while it waits for the turn
ends it at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Callable

import psutil
import pytest
import zmq
from vllm.utils.network_utils import zmq_socket_ctx

from asyncrl.file_lock import FileLock
from asyncrl.stop_signal import STOP_SIGNALS, interrupt_once
from tests.unit.rollout_servers.test_server_groups import build_server
from waiting import wait_until

WAIT_S = 60.0  # generous: what is waited for happens within a second


class StartedEngine:
    """What the start returns: a running engine, which records its shutdown."""

    def __init__(self) -> None:
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


def stopped_while_starting(handshake: Path, signum: int, outcome: Callable[[], StartedEngine]):
    """A `RolloutEngine.start` whose process gets `signum` while it waits for the engine core's handshake, the way
    vLLM waits; it then returns `outcome()` (or raises what `outcome` raises)."""
    async def start(model_path: str, config: object, version: int = 0, lora: object = None,
                    gpu_memory_gib: float = 0.0, process_is_fresh: bool = False) -> StartedEngine:
        with zmq_socket_ctx(f"ipc://{handshake}", zmq.ROUTER, bind=True):
            signal.raise_signal(signum)  # the supervisor stops the server (SIGTERM), or a Ctrl-C reaches it (SIGINT)
        return outcome()
    return start


def spawned_children() -> set[int]:
    """This process's children that multiprocessing spawned to run a target (not its resource tracker)."""
    found = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # gone, or a zombie, meanwhile
            if "spawn_main" in " ".join(child.cmdline()):
                found.add(child.pid)
    return found


def never_reached(what: str) -> Callable[..., None]:
    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a server stopped while its engine started {what}")
    return reached


@pytest.fixture
def server_process_stops():
    """Stop signals handled as in a server's process (`serve_one`); the test process's handlers back afterwards."""
    previous = {stop_signal: signal.getsignal(stop_signal) for stop_signal in STOP_SIGNALS}
    interrupt_once()
    yield
    for stop_signal, handler in previous.items():
        signal.signal(stop_signal, handler)


@pytest.fixture
def server(tmp_path, monkeypatch, server_process_stops):
    monkeypatch.setattr("rollout_servers.server.SyncClient", never_reached("joined weight sync"))
    monkeypatch.setattr("rollout_servers.server.AdmissionClient", never_reached("asked the buffer for work"))
    return build_server(tmp_path)


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda signum: signal.Signals(signum).name)
def test_a_server_stopped_while_its_engine_starts_shuts_the_started_engine_down_and_stops(server, tmp_path,
                                                                                         monkeypatch, signum):
    engine = StartedEngine()
    monkeypatch.setattr("rollout_servers.server.RolloutEngine.start",
                        stopped_while_starting(tmp_path / "handshake", signum, lambda: engine))
    before = spawned_children()
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(server.serve())
    assert engine.shut_down
    assert not spawned_children() - before, "the reward workers, spawned as the start began, are stopped"
    assert all(signal.getsignal(stop_signal) is signal.SIG_IGN for stop_signal in STOP_SIGNALS), \
        "the teardown of a stopped server is not interrupted by a second stop (interrupt_once)"


def test_a_start_that_fails_after_the_stop_ends_as_stopped(server, tmp_path, monkeypatch):
    def engine_core_stopped_too() -> StartedEngine:
        raise RuntimeError("Engine core initialization failed")

    monkeypatch.setattr("rollout_servers.server.RolloutEngine.start",
                        stopped_while_starting(tmp_path / "handshake", signal.SIGINT, engine_core_stopped_too))
    with pytest.raises(KeyboardInterrupt) as stopped:
        asyncio.run(server.serve())
    assert isinstance(stopped.value.__context__, RuntimeError)  # the failure is kept as the stop's context


def holds_the_gpus_turn(turns_dir: Path, gpu: int) -> Callable[..., object]:
    """A `RolloutEngine.start` that checks, as it runs, that this server holds `gpu`'s start turn, and returns a
    started engine."""
    async def start(*args: object, **kwargs: object) -> StartedEngine:
        lock = FileLock(turns_dir / f"gpu{gpu}.lock")
        assert not lock.take(0.0, lambda holder: None), "the engine started without its GPU's start turn"
        assert lock.holder().endswith("(server-0 starting)")
        raise EngineStarted(StartedEngine())
    return start


class EngineStarted(Exception):
    """Ends the server's serve() once its engine started, before it reaches the learner."""


def test_a_server_on_a_gpu_starts_its_engine_in_that_gpus_turn_and_lets_go_of_it(server, tmp_path, monkeypatch):
    monkeypatch.setattr("rollout_servers.server.visible_gpus", lambda: [7])
    monkeypatch.setattr("rollout_servers.engine_turns.TURNS_DIR", tmp_path / "turns")
    monkeypatch.setattr("rollout_servers.server.RolloutEngine.start", holds_the_gpus_turn(tmp_path / "turns", 7))
    with pytest.raises(EngineStarted):
        asyncio.run(server.serve())
    assert FileLock(tmp_path / "turns" / "gpu7.lock").take(0.0, lambda holder: None), "the turn was kept"


def test_a_server_stopped_while_it_waits_for_its_gpus_turn_stops_at_once_without_starting(server, tmp_path,
                                                                                         monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="rollout_servers.engine_turns")
    monkeypatch.setattr("rollout_servers.server.visible_gpus", lambda: [7])
    monkeypatch.setattr("rollout_servers.engine_turns.TURNS_DIR", tmp_path / "turns")
    monkeypatch.setattr("rollout_servers.server.RolloutEngine.start", never_reached("started an engine"))
    holder = FileLock(tmp_path / "turns" / "gpu7.lock")
    assert holder.take(0.0, lambda who: None, holder="server-1 starting")  # another engine starts on GPU 7

    def stop_once_it_waits() -> None:  # the supervisor stops the server while it waits
        wait_until(lambda: "server-0 waits for its turn to start on GPU 7" in caplog.text, WAIT_S, "the server waiting")
        os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_once_it_waits)
    stopper.start()
    with pytest.raises(KeyboardInterrupt):  # while the turn is still held: the stop did not wait for it
        asyncio.run(server.serve())
    stopper.join()
    holder.release()
