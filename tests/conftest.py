"""Session-wide test hooks."""

from __future__ import annotations

import logging
import os
import sys

import pytest


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


@pytest.fixture(autouse=True)
def _drop_role_log_handlers():
    """A test that runs a role's main in-process gets `setup_logging`'s handlers on the root logger,
    bound to the stderr pytest captured for that test; later tests would log into that closed stream."""
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if type(h) in (logging.StreamHandler, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()
