"""Logging setup: the standard `logging` module with the role in every line's prefix."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def setup_logging(role: str, level: str = "INFO", log_file: str | Path | None = None) -> logging.Logger:
    """Configure the root logger for a role process; returns the role's logger."""
    fmt = logging.Formatter(f"%(asctime)s [{role}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    root.addHandler(console)
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(fmt)
        root.addHandler(handler)
    return logging.getLogger(f"asyncrl.{role}")
