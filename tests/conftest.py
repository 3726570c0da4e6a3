"""Session-wide test hooks."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from keyword_filter import keyword_words, mentions_any
from mp_reaping import one_reaper_at_a_time

one_reaper_at_a_time()  # threads here start and join processes at once (mp_reaping.py says why)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave as soon as the results are reported. vLLM's engine clients hold ZeroMQ contexts whose
    finalisers block forever in `Context.term()` once the engine processes are gone, and pytest's
    final garbage collection (or the interpreter's) runs them: without this the suite passes, then
    never exits."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash.get(_EXIT_STATUS, 0))


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-k WORDS`, skip test files, and folders of them, whose path and text contain none of the words: they
    hold no test `-k` could select, and importing them (torch, transformers, vLLM) made `pytest -k <one test>` take
    30 s. Any expression this cannot read safely (`not`, short or numeric words, which generated ids may match) skips
    nothing."""
    words = keyword_words(config.option.keyword)
    if not words:
        return None
    if collection_path.is_dir():
        files = list(collection_path.rglob("test_*.py"))
    elif collection_path.name.startswith("test_") and collection_path.suffix == ".py":
        files = [collection_path]
    else:
        return None
    return None if any(mentions_any(path, words) for path in files) else True


@pytest.fixture(autouse=True)
def _drop_role_log_handlers():
    """A test that runs a role's main in-process gets `setup_logging`'s handlers on the root logger,
    bound to the stderr pytest captured for that test; later tests would log into that closed stream."""
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if type(h) in (logging.StreamHandler, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


@pytest.fixture(autouse=True)
def _stop_signal_handlers_restored():
    """A test that runs a role's stop handling in-process (`interrupt_once`, `ignore_stop_signals`) changes this
    process's SIGTERM and SIGINT handlers. Left ignored (test_server_leaving.py did), every process a later test
    starts inherits SIG_IGN and outlives the SIGTERM meant to stop it: the reaper's test, run after it, saw its role
    die of the SIGKILL that follows the grace."""
    before = {stop: signal.getsignal(stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    yield
    for stop, handler in before.items():
        if signal.getsignal(stop) != handler:
            signal.signal(stop, handler)
