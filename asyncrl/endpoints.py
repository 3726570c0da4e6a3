"""Where a run's services listen, shared through the run directory, and the end of the run."""

from __future__ import annotations

import json
from pathlib import Path

ENDPOINTS_FILE = "endpoints.json"  # written by learner rank 0: {"buffer": "tcp://...", "sync": "tcp://..."}
FINISHED_KEY = "finished"  # once the learner has trained its last step the file holds {"finished": final version}


def read_endpoints(run_dir: Path) -> dict | None:
    """The run's endpoints file, or None while there is none (the learner has not yet bound its services)."""
    try:
        return json.loads((Path(run_dir) / ENDPOINTS_FILE).read_text())
    except FileNotFoundError:
        return None


def write_endpoints(run_dir: Path, found: dict) -> None:
    """Replace the endpoints file at once (a reader never sees half of it)."""
    path = Path(run_dir) / ENDPOINTS_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(found))
    partial.replace(path)
