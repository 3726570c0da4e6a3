"""A benchmark that runs another one as a child process: the child's console shown, its RESULT read back, and its
failure ending the caller with a message naming what it measured."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Sequence

RESULT_PREFIX = "RESULT "


def result_of(command: Sequence[str], what: str, timeout_s: float | None = None,
              show_result: bool = False) -> dict[str, Any] | None:
    """Run `command` (`python script.py ...`), show what it printed (its RESULT lines only where `show_result`: else
    the caller's own RESULT stays the only one on its console) and return its last RESULT's JSON, None where it printed
    none; SystemExit "`what`: <script> exited with N" where it failed."""
    done = subprocess.run(list(command), stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    lines = done.stdout.splitlines(keepends=True)
    shown = lines if show_result else [line for line in lines if not line.startswith(RESULT_PREFIX)]
    print("".join(shown), end="", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"{what}: {Path(command[1]).name} exited with {done.returncode}")
    results = [line[len(RESULT_PREFIX):] for line in lines if line.startswith(RESULT_PREFIX)]
    return json.loads(results[-1]) if results else None
