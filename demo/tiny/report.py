"""The report `asyncrl init-model` writes beside the model it built: its cache key, size, accuracies and the digest of
its weights. Read without torch, by whoever needs to know which model a directory holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPORT_FILE = "init_report.json"  # written into the model directory


def read_report(model_dir: Path) -> dict[str, Any]:
    """The report in `model_dir`; empty where none was written (a model not built by init-model)."""
    path = model_dir / REPORT_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
