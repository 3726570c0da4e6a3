"""What a rollout server leaves in its error file for its supervisor: the error its vLLM engine core logged as it
died (a handler the vLLM plugin installs), else the server's own failure; never the bare `EngineDeadError` that
names no reason."""

from __future__ import annotations

import logging

import pytest
from vllm.v1.engine.exceptions import EngineDeadError

from rollout_servers import server_logs
from rollout_servers.server_logs import (
    ENGINE_CORE_LOGGER, expect_errors, read_error, record_engine_errors, record_server_error, server_error_file,
)


@pytest.fixture
def error_file(tmp_path, monkeypatch):
    """A server's error file, named for this process as `serve_one` names it; the handler removed afterwards."""
    monkeypatch.delenv(server_logs.ERROR_FILE_ENV, raising=False)
    path = server_error_file(tmp_path, 1)
    path.parent.mkdir(parents=True)
    path.write_text("RuntimeError: the previous process's\n")
    expect_errors(path)
    yield path
    logger = logging.getLogger(ENGINE_CORE_LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, server_logs._FatalEngineError)]:
        logger.removeHandler(handler)


def engine_core_dies(message: str) -> None:
    """What vLLM's engine core does with the exception that ends it."""
    try:
        raise RuntimeError(message)
    except RuntimeError:
        logging.getLogger(ENGINE_CORE_LOGGER).exception("EngineCore encountered a fatal error.")


def test_a_new_server_process_starts_without_the_previous_ones_error(error_file):
    assert error_file == error_file.parent / "rollout1.error" and read_error(error_file) is None


def test_the_engine_cores_fatal_error_is_recorded_and_the_servers_engine_dead_error_is_not(error_file):
    record_engine_errors()
    record_engine_errors()  # the plugin may load twice in a process: one handler
    assert sum(isinstance(h, server_logs._FatalEngineError) for h in logging.getLogger(ENGINE_CORE_LOGGER).handlers) == 1
    engine_core_dies("Worker failed with error 'Unsupported CPU attention configuration: head_dim=16'")
    record_server_error(ValueError("a later failure of the server, caused by the dead engine"))
    assert read_error(error_file) == "RuntimeError: Worker failed with error 'Unsupported CPU attention configuration: head_dim=16'"


def test_the_servers_own_failure_is_recorded_where_its_engine_recorded_none(error_file):
    record_server_error(EngineDeadError())  # an engine core killed by a signal names no reason: nothing recorded
    assert read_error(error_file) is None
    record_server_error(ValueError("max_model_len 100000 exceeds the model's 256 positions"))
    assert read_error(error_file) == "ValueError: max_model_len 100000 exceeds the model's 256 positions"


def test_nothing_is_recorded_outside_a_server(tmp_path, monkeypatch):
    monkeypatch.delenv(server_logs.ERROR_FILE_ENV, raising=False)
    record_engine_errors()
    assert not any(isinstance(h, server_logs._FatalEngineError) for h in logging.getLogger(ENGINE_CORE_LOGGER).handlers)
    record_server_error(ValueError("no file named"))
    assert not list(tmp_path.iterdir())
