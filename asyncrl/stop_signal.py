"""Stop signals: a flag set by SIGTERM or SIGINT, for supervising loops that must stop their children cleanly,
the switch that keeps a process that has begun to stop from being interrupted in its teardown, and a hold for
code that would swallow the KeyboardInterrupt of a stop."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    def __init__(self) -> None:
        self.requested = False
        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, self._request)

    def _request(self, signum: int, frame: object) -> None:
        self.requested = True


def interrupt_on_stop_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt from now on: a role stopped by its launcher unwinds through its
    `finally` blocks instead of dying where it stands. SIGINT is set too, not left to Python: a process started as a
    background job of a script inherits SIGINT ignored, Python then keeps it ignored, and a `kill -INT` (or the
    script's Ctrl-C) would leave the job running."""
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, signal.default_int_handler)


def interrupt_once() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt once: the first stop starts the teardown, and any later one is
    ignored (`ignore_stop_signals`), so that it cannot break the teardown halfway."""
    def interrupt(signum: int, frame: object) -> None:
        ignore_stop_signals()
        raise KeyboardInterrupt

    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, interrupt)


def ignore_stop_signals() -> None:
    """From now on SIGTERM and SIGINT do nothing: call once a process has begun to stop. A role's process often
    gets the same stop twice (from `asyncrl run` to the whole process group, then from its own supervisor), and a
    second KeyboardInterrupt would break the teardown halfway (vLLM's shutdown, atexit handlers). Whoever sent
    the signal still escalates to SIGKILL if the process does not exit in time."""
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, signal.SIG_IGN)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Run the block with SIGTERM and SIGINT only recorded; on leaving it, put the handlers from before it back and
    send this process the first stop that came meanwhile, so that they act on it there (after `interrupt_once`:
    KeyboardInterrupt, which replaces any exception the block raised: a block that failed because of the stop, or
    finished despite it, ends as stopped).

    For a block that catches KeyboardInterrupt and carries on: vLLM's engine start waits for its engine core's
    handshake inside `zmq_socket_ctx`, which swallows it, and the start then goes on to a running engine. Main
    thread only, like every signal handler."""
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        held.append(signum)

    previous = {stop_signal: signal.signal(stop_signal, hold) for stop_signal in STOP_SIGNALS}
    try:
        yield
    finally:
        for stop_signal, handler in previous.items():
            signal.signal(stop_signal, handler)
        if held:
            signal.raise_signal(held[0])
