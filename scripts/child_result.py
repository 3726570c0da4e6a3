"""A benchmark that runs another one as a child process: the child's console shown, its RESULT read back, and its
failure ending the caller with a message naming what it measured."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any, Sequence

RESULT_PREFIX = "RESULT "


def result_of(command: Sequence[str], what: str, timeout_s: float | None = None,
              show_result: bool = False) -> dict[str, Any] | None:
    """Run `command` (`python script.py ...`), show each line it prints as it prints it (its RESULT lines only where
    `show_result`: else the caller's own RESULT stays the only one on its console) and return its last RESULT's JSON,
    None where it printed none; SystemExit "`what`: <script> exited with N" where it failed, and "`what`: <script>
    ran past N s" where it ran past `timeout_s` (it is killed then). Shown as they come, so that a run cut short on
    a lent host leaves what the child had done in the caller's log."""
    results: list[str] = []
    ran_past = threading.Event()
    with subprocess.Popen(list(command), stdout=subprocess.PIPE, text=True) as child:
        watchdog = threading.Timer(timeout_s, lambda: (ran_past.set(), child.kill())) if timeout_s is not None else None
        if watchdog is not None:
            watchdog.start()
        try:
            for line in child.stdout:
                if line.startswith(RESULT_PREFIX):
                    results.append(line[len(RESULT_PREFIX):])
                if show_result or not line.startswith(RESULT_PREFIX):
                    print(line, end="", flush=True)
        except BaseException:  # the caller stopped (Ctrl-C, a failed print): the child does not outlive it
            child.kill()
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
            returncode = child.wait()
    script = Path(command[1]).name
    if ran_past.is_set():
        raise SystemExit(f"{what}: {script} ran past {timeout_s:g} s")
    if returncode != 0:
        raise SystemExit(f"{what}: {script} exited with {returncode}")
    return json.loads(results[-1]) if results else None
