"""Stop signals: a flag set by SIGTERM or SIGINT, for supervising loops that must stop their children cleanly,
the switch that keeps a process that has begun to stop from being interrupted in its teardown, and a hold for
code that would swallow the KeyboardInterrupt of a stop."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Iterator

log = logging.getLogger(__name__)

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
    redeliver_stops_lost_in_finalizers()
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, signal.default_int_handler)


def interrupt_once() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt once: the first stop starts the teardown, and any later one is
    ignored (`ignore_stop_signals`), so that it cannot break the teardown halfway."""
    def interrupt(signum: int, frame: object) -> None:
        ignore_stop_signals()
        raise KeyboardInterrupt

    redeliver_stops_lost_in_finalizers()
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, interrupt)


def redeliver_stops_lost_in_finalizers() -> None:
    """A stop's KeyboardInterrupt raised while the main thread runs a finalizer (a `__del__` that the garbage
    collector calls, a weakref callback) is printed as "Exception ignored" and lost: the process would go on as if
    never stopped, and after `interrupt_once` no later signal could stop it. From now on such a lost stop is raised
    again in the main thread, once it is out of the finalizer."""
    if sys.unraisablehook is _redeliver_lost_stop:
        return
    global _report_unraisable
    _report_unraisable = sys.unraisablehook
    sys.unraisablehook = _redeliver_lost_stop


_report_unraisable = sys.__unraisablehook__
REDELIVER_EVERY_S = 0.01  # how often a lost stop is raised again until it lands outside a finalizer
REDELIVER_WITHIN_S = 10.0  # then it gives up (a finalizer that runs this long is a bug of its own)


def _redeliver_lost_stop(unraisable: Any) -> None:
    _report_unraisable(unraisable)
    lost_stop = unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt)
    if lost_stop and threading.current_thread() is threading.main_thread() and not sys.is_finalizing():
        log.warning("a stop signal arrived inside a finalizer, which swallowed it: raising it again")
        _raise_again_outside_finalizers()


def _raise_again_outside_finalizers() -> None:
    """KeyboardInterrupt in the main thread at its first instruction outside a finalizer, once, whatever SIGINT's
    handler is now (after `interrupt_once` it is ignored); that handler is back once it is raised. A thread asks
    again each time the handler has found the main thread still in a finalizer (asked from inside the handler, the
    handler would run inside itself), one request at a time: a request sent while the handler runs would reach the
    handler put back and stop the process a second time, mid-way through its reaction to the first (seen on a
    loaded machine). It gives up after REDELIVER_WITHIN_S."""
    handler_now = signal.getsignal(signal.SIGINT)
    raised, handled = threading.Event(), threading.Event()
    main_thread = threading.main_thread().ident

    def interrupt(signum: int, frame: FrameType | None) -> None:
        try:
            if _in_finalizer(frame):  # raised here, it would be swallowed again: the thread asks again
                return
            signal.signal(signal.SIGINT, handler_now)
            raised.set()
            raise KeyboardInterrupt
        finally:
            handled.set()

    def ask() -> None:
        deadline = time.monotonic() + REDELIVER_WITHIN_S
        while time.monotonic() < deadline:
            handled.clear()
            # a real signal, where interrupt_main only marks the handler due: it also ends a blocking wait (a sleep,
            # a socket's poll) of the main thread, which would otherwise sit out the wait before stopping
            signal.pthread_kill(main_thread, signal.SIGINT)
            # the request is pending until the handler has run on it: never a second one beside it
            if handled.wait(max(0.0, deadline - time.monotonic())) and raised.is_set():
                return
            time.sleep(REDELIVER_EVERY_S)  # the main thread was still in a finalizer
        log.warning("a stop lost in a finalizer could not be raised again within %.0f s", REDELIVER_WITHIN_S)

    signal.signal(signal.SIGINT, interrupt)
    threading.Thread(target=ask, name="stop-redelivery", daemon=True).start()


def _in_finalizer(frame: FrameType | None) -> bool:
    """Whether `frame` runs inside a `__del__` or inside the hook that reports what a finalizer raised."""
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code is _redeliver_lost_stop.__code__:
            return True
        frame = frame.f_back
    return False


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
