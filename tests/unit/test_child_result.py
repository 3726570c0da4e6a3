"""A benchmark's child benchmark (scripts/child_result.py): its console shown, its RESULT lines kept off the caller's
console unless asked for, its last RESULT returned, and its failure named."""

import sys

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
