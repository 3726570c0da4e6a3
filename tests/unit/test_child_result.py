"""A benchmark's child benchmark (scripts/child_result.py): its console shown, its RESULT lines kept off the caller's
console unless asked for, its last RESULT returned, and its failure named."""

import contextlib
import io
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from scripts.child_result import result_of

PRINTS = "print('table'); print('RESULT {\"a\": 1}'); print('RESULT {\"a\": 2}')"


def child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_last_result_is_returned_and_kept_off_the_console_unless_asked(capsys):
    assert result_of(child(PRINTS), "a count") == {"a": 2}
    assert capsys.readouterr().out == "table\n"
    assert result_of(child(PRINTS), "a layout", show_result=True) == {"a": 2}
    assert capsys.readouterr().out == 'table\nRESULT {"a": 1}\nRESULT {"a": 2}\n'
    assert result_of(child("print('table')"), "a count") is None


def test_a_failed_child_ends_the_caller_naming_what_it_measured():
    with pytest.raises(SystemExit, match="^the engine's ceiling: -c exited with 3$"):
        result_of(child("raise SystemExit(3)"), "the engine's ceiling")


class Console(io.StringIO):
    """The caller's console, which makes `seen` once a line holding `first` reaches it."""

    def __init__(self, seen: Path) -> None:
        super().__init__()
        self.seen = seen

    def write(self, text: str) -> int:
        if "first" in text:
            self.seen.touch()
        return super().write(text)


def test_each_line_is_shown_as_the_child_prints_it(tmp_path):
    # the child goes on only once its first line is on the caller's console: shown only at its end, it never would
    seen = tmp_path / "seen"
    code = (f"import pathlib, time; print('first', flush=True); seen = pathlib.Path({str(seen)!r}); "
            "deadline = time.monotonic() + 60\n"
            "while not seen.exists() and time.monotonic() < deadline: time.sleep(0.05)\n"
            "print('RESULT {\"seen\": %s}' % str(seen.exists()).lower())")
    console = Console(seen)
    with contextlib.redirect_stdout(console):
        assert result_of(child(code), "a count") == {"seen": True}
    assert console.getvalue() == "first\n"


def test_a_child_past_its_time_is_killed_and_named():
    with pytest.raises(SystemExit, match="^2 engine\\(s\\): -c ran past 0.5 s$"):
        result_of(child("import time; print('started', flush=True); time.sleep(60)"), "2 engine(s)", timeout_s=0.5)


class Broken(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError("the caller's console went away")


def test_a_caller_that_fails_while_showing_a_line_stops_the_child(tmp_path):
    # the child would sleep an hour past its first line: the caller's failure must end it, not wait for it
    pid_file = tmp_path / "pid"
    code = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "print('first', flush=True); time.sleep(3600)")
    failures = []

    def call() -> None:
        with contextlib.redirect_stdout(Broken()):
            try:
                result_of(child(code), "a count")
            except BrokenPipeError as error:
                failures.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=30)
    try:
        assert not caller.is_alive(), "the caller waited for its child"
        assert len(failures) == 1
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)  # killed and reaped
    finally:
        if caller.is_alive():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
