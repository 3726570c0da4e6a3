"""bench_weight_sync's waits on its children: an answer is taken as soon as it comes, and a child that exits without
answering (a failed engine start) ends the wait at once instead of after the benchmark's 600 s bound."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from scripts.bench_weight_sync import answer

FORK = multiprocessing.get_context("fork")  # quick to start; answer() reads only the queue and exit codes


def _answers_then_exits(results) -> None:
    results.put("ready")


def _fails_without_answering(results) -> None:
    raise SystemExit(3)


def test_an_answer_put_just_before_the_child_exits_is_returned():
    results = FORK.Queue()
    child = FORK.Process(target=_answers_then_exits, args=(results,))
    child.start()
    child.join(30)
    assert answer(results, child) == "ready"


def test_a_child_that_exits_without_answering_ends_the_wait_at_once():
    results = FORK.Queue()
    child = FORK.Process(target=_fails_without_answering, args=(results,), name="engine-0")
    child.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="engine-0 exited with 3 before answering"):
        answer(results, child)
    assert time.monotonic() - started < 30  # the bound it replaces is 600 s
