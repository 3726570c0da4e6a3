"""A rollout server stopped while its vLLM engine starts never serves. vLLM waits for its engine core's handshake
inside `zmq_socket_ctx`, which catches the KeyboardInterrupt of the stop and lets the start go on to a running
engine; the server acts on the stop once the start is over: it shuts that engine down and ends as stopped, before
it joins weight sync or asks the buffer for work. A start that fails because of the stop (a Ctrl-C reaches the
engine core too) ends as stopped as well. The engine start is stood in for; the context that swallows the
interrupt is vLLM's own, and the stop is handled as the server's process handles it (`interrupt_once`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Callable

import psutil
import pytest
import zmq
from vllm.utils.network_utils import zmq_socket_ctx

from asyncrl.stop_signal import STOP_SIGNALS, interrupt_once
from tests.unit.rollout_servers.test_server_groups import build_server


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
