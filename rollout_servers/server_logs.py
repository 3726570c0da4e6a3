"""Where a rollout server writes its log, and the error it died of (`logs/rollout<i>.error`, beside the log) for
whoever restarts it: the local supervisor and the Ray launcher give up when the same error ends its starts in a
row (`asyncrl.restarts`), naming that error.

vLLM runs the model in processes of its own: when its engine core dies, the server hears only that it died
(`EngineDeadError`, which names no reason; the reason went to the engine core's stderr). So the engine core records
its own fatal error, through a handler that the vLLM plugin installs in every vLLM process
(`record_engine_errors`), and the server records its own failure only where the engine recorded none. Light to
import: the supervisor and the Ray launcher read these files without vLLM or torch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from asyncrl.restarts import error_signature

ERROR_FILE_ENV = "ASYNCRL_SERVER_ERROR_FILE"  # set by a server for itself and the vLLM processes it starts
ENGINE_CORE_LOGGER = "vllm.v1.engine.core"  # where vLLM's engine core logs its fatal error, traceback attached


def server_log(run_dir: Path | str, index: int) -> Path:
    """Where server `index` of the run in `run_dir` logs."""
    return Path(run_dir) / "logs" / f"rollout{index}.log"


def server_error_file(run_dir: Path | str, index: int) -> Path:
    """Where server `index` of the run in `run_dir` leaves the error it died of."""
    return server_log(run_dir, index).with_suffix(".error")


def expect_errors(path: Path) -> None:
    """In a server process, before its engine starts: forget the previous process's error, and name the file for
    the vLLM processes it starts (they inherit the environment)."""
    path.unlink(missing_ok=True)
    os.environ[ERROR_FILE_ENV] = str(path)


def record_server_error(error: BaseException) -> None:
    """The server's own failure, unless its engine recorded the error it died of. A dead engine the server only
    heard of (killed by a signal, say) leaves nothing: `EngineDeadError` is alike whatever killed it."""
    from vllm.v1.engine.exceptions import EngineDeadError  # only a server, which runs vLLM, records errors

    path = os.environ.get(ERROR_FILE_ENV)
    if path and not Path(path).exists() and not isinstance(error, EngineDeadError):
        _write(Path(path), error_signature(error))


def record_engine_errors() -> None:
    """In a vLLM process that a server started: the engine core's fatal error goes to the server's error file
    (installed once per process; nothing outside a server)."""
    path = os.environ.get(ERROR_FILE_ENV)
    logger = logging.getLogger(ENGINE_CORE_LOGGER)
    if path and not any(isinstance(handler, _FatalEngineError) for handler in logger.handlers):
        logger.addHandler(_FatalEngineError(Path(path)))


def read_error(path: Path) -> str | None:
    """The error recorded at `path`, None when there is none."""
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


class _FatalEngineError(logging.Handler):
    """Writes the exception of each error record (the engine core logs its fatal one just before it dies)."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.ERROR)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            _write(self.path, error_signature(record.exc_info[1]))


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    except OSError:  # a full or read-only disk: the restarts fall back to the restart limit
        pass
