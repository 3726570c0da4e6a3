"""Small state files written whole: the new content goes to a partial file beside the path, then replaces it, so a
reader (or a restart after a kill) sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json_whole(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, replacing what was there at once; its folder is made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value))
    partial.replace(path)
