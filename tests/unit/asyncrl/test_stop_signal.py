"""interrupt_on_stop_signals turns a stop into a KeyboardInterrupt, also a SIGINT the process inherited ignored (a
script's background job); ignore_stop_signals lets a process that has begun to
stop finish its teardown through a second stop signal; interrupt_once does both, the teardown protected from the
moment of the first stop; stop_signals_held keeps a stop from a block that would swallow its KeyboardInterrupt and
hands it to the handlers as the block ends."""

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(30)

STOPPING_TWICE = """
import atexit, os, signal, sys, time
from asyncrl.stop_signal import ignore_stop_signals, interrupt_on_stop_signals
interrupt_on_stop_signals()  # as a rollout server does
def teardown():
    os.kill(os.getpid(), signal.SIGTERM)  # the second stop, while the exit path runs
    time.sleep(0.2)  # a teardown that takes a while: the second stop lands inside it
    print("teardown finished", flush=True)
atexit.register(teardown)
try:
    os.kill(os.getpid(), signal.SIGTERM)  # the first stop
    time.sleep(10)  # ended by that stop's KeyboardInterrupt
except KeyboardInterrupt:
    print("stopping", flush=True)
finally:
    if sys.argv[1] == "ignore":
        ignore_stop_signals()
"""


def run_stopped_twice(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", STOPPING_TWICE, mode], capture_output=True, text=True, timeout=20)


def test_a_second_stop_signal_does_not_break_the_teardown():
    done = run_stopped_twice("ignore")
    assert done.stdout.split("\n")[:2] == ["stopping", "teardown finished"]
    assert "KeyboardInterrupt" not in done.stderr


def test_without_it_the_second_stop_interrupts_the_teardown():  # the probe shows the hazard it guards
    done = run_stopped_twice("default")
    assert "teardown finished" not in done.stdout and "KeyboardInterrupt" in done.stderr


# A rollout server's case: the teardown runs inside the interrupted call (asyncio.run cancelling its tasks), before
# any `finally` of the caller could switch the signals off.
TEARDOWN_INSIDE = """
import os, signal, time
from asyncrl.stop_signal import interrupt_once
interrupt_once()
try:
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the first stop
        time.sleep(10)  # ended by that stop's KeyboardInterrupt
    finally:
        os.kill(os.getpid(), signal.SIGINT)  # the second, while the teardown runs
        time.sleep(0.2)  # a teardown that takes a while: the second stop lands inside it
        print("teardown finished", flush=True)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def test_interrupt_once_protects_a_teardown_from_the_first_stop_on():
    done = subprocess.run([sys.executable, "-c", TEARDOWN_INSIDE], capture_output=True, text=True, timeout=20)
    assert done.stdout.split("\n")[:2] == ["teardown finished", "stopped"], done.stderr


# `asyncrl learner` started with `&` from a script: the shell starts it with SIGINT ignored, and Python keeps that.
SIGINT_INHERITED_IGNORED = """
import os, signal, sys, time
from asyncrl.stop_signal import interrupt_on_stop_signals
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "started with SIGINT ignored"
if sys.argv[1] == "interrupt":
    interrupt_on_stop_signals()
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(3)
    print("slept through it", flush=True)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def run_with_sigint_ignored(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SIGINT_INHERITED_IGNORED, mode], capture_output=True, text=True,
                          timeout=20, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def test_a_sigint_inherited_ignored_stops_the_process_once_it_asks_for_stop_signals():
    assert run_with_sigint_ignored("interrupt").stdout == "stopped\n"
    assert run_with_sigint_ignored("inherited").stdout == "slept through it\n"  # the hazard it guards


# A rollout server's engine start: the block (vLLM's) would catch the KeyboardInterrupt and carry on.
HELD = """
import os, signal, time
from asyncrl.stop_signal import interrupt_once, stop_signals_held
interrupt_once()
with stop_signals_held():
    pass  # no stop came
print(signal.getsignal(signal.SIGTERM).__name__, flush=True)
try:
    with stop_signals_held():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        except KeyboardInterrupt:
            print("swallowed", flush=True)
        print("the block went on", flush=True)
    print("not stopped", flush=True)
except KeyboardInterrupt:
    print("stopped as the block ended", flush=True)
"""


def test_a_stop_held_during_a_block_is_acted_on_as_it_ends_and_the_handlers_are_back_without_one():
    done = subprocess.run([sys.executable, "-c", HELD], capture_output=True, text=True, timeout=20)
    assert done.stdout.split("\n")[:3] == ["interrupt", "the block went on", "stopped as the block ended"], done.stderr


# A learner rank's case: the stop lands while the garbage collector runs a `__del__` (regex's, as a rank starts),
# which prints the KeyboardInterrupt as "Exception ignored" and goes on; interrupt_once then ignores every later stop.
STOPPED_IN_A_FINALIZER = """
import gc, os, signal, sys, time
from asyncrl.stop_signal import interrupt_once, interrupt_on_stop_signals
{"once": interrupt_once, "every": interrupt_on_stop_signals}[sys.argv[1]]()
class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the stop, while a finalizer runs
        time.sleep(0.01)
gc.disable()
dropped = Finalized()
dropped.cycle = dropped
del dropped
try:
    gc.collect()  # runs the __del__
    time.sleep(60)  # a wait the stop must end (a learner rank waiting for its servers): longer than the test waits
    print("slept through the stop", flush=True)
except KeyboardInterrupt:
    print("stopped", flush=True)
handler = signal.getsignal(signal.SIGINT)
print({signal.SIG_IGN: "ignored", signal.default_int_handler: "interrupts"}.get(handler, handler), flush=True)
"""


@pytest.mark.parametrize("handler", ["once", "every"])
def test_a_stop_that_lands_in_a_finalizer_still_stops_the_process_once(handler):
    done = subprocess.run([sys.executable, "-c", STOPPED_IN_A_FINALIZER, handler], capture_output=True, text=True,
                          timeout=20)
    lines = done.stdout.split("\n")
    assert lines[0] == "stopped", done.stderr
    assert "raising it again" in done.stderr
    # the handler before the lost stop is back: ignored after interrupt_once, KeyboardInterrupt after the other
    assert lines[1] == ("ignored" if handler == "once" else "interrupts"), lines
