"""Logging setup: the standard `logging` module with the role in every line's prefix."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


class BriefConsole(logging.Formatter):
    """Console lines of a role that logs to a file as well: a record's traceback goes to the file only, and its
    console line says where to find it (a failure is one line on the console, all of it in the role's log)."""

    def __init__(self, fmt: str, datefmt: str, log_file: str | Path) -> None:
        super().__init__(fmt, datefmt)
        self.log_file = log_file

    def format(self, record: logging.LogRecord) -> str:
        if not record.exc_info:
            return super().format(record)
        brief = logging.makeLogRecord(record.__dict__ | {"exc_info": None, "exc_text": None})
        return f"{super().format(brief)} (traceback in {self.log_file})"


def setup_logging(role: str, level: str = "INFO", log_file: str | Path | None = None) -> logging.Logger:
    """Configure the root logger for a role process; returns the role's logger."""
    line, datefmt = f"%(asctime)s [{role}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"
    fmt = logging.Formatter(line, datefmt)
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(BriefConsole(line, datefmt, log_file) if log_file is not None else fmt)
    root.addHandler(console)
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(fmt)
        root.addHandler(handler)
    return logging.getLogger(f"asyncrl.{role}")
