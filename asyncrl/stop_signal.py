"""Stop signals: a flag set by SIGTERM or SIGINT, for supervising loops that must stop their children cleanly,
and the switch that keeps a process that has begun to stop from being interrupted in its teardown."""

from __future__ import annotations

import signal


class StopSignal:
    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum: int, frame: object) -> None:
        self.requested = True


def interrupt_on_stop_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt from now on: a role stopped by its launcher unwinds through its
    `finally` blocks instead of dying where it stands. SIGINT is set too, not left to Python: a process started as a
    background job of a script inherits SIGINT ignored, Python then keeps it ignored, and a `kill -INT` (or the
    script's Ctrl-C) would leave the job running."""
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, signal.default_int_handler)


def interrupt_once() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt once: the first stop starts the teardown, and any later one is
    ignored (`ignore_stop_signals`), so that it cannot break the teardown halfway."""
    def interrupt(signum: int, frame: object) -> None:
        ignore_stop_signals()
        raise KeyboardInterrupt

    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, interrupt)


def ignore_stop_signals() -> None:
    """From now on SIGTERM and SIGINT do nothing: call once a process has begun to stop. A role's process often
    gets the same stop twice (from `asyncrl run` to the whole process group, then from its own supervisor), and a
    second KeyboardInterrupt would break the teardown halfway (vLLM's shutdown, atexit handlers). Whoever sent
    the signal still escalates to SIGKILL if the process does not exit in time."""
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, signal.SIG_IGN)
