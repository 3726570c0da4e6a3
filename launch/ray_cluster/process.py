"""One role process started by a Ray actor: its own session (so that stopping it reaches everything it
starts), its output streamed line by line to the actor's stdout (Ray forwards that to the driver) and
to a log file, and a reaper (reaper.py) that stops the session if the actor dies first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence


class RoleProcess:
    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: str, log_path: Path, grace_s: float) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self.process = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self._pump = threading.Thread(target=_copy_lines, args=(self.process.stdout, log_path), daemon=True)
        self._pump.start()
        reaper = [sys.executable, "-m", "launch.ray_cluster.reaper", str(os.getpid()), str(self.process.pid), str(grace_s)]
        subprocess.run(reaper, cwd=cwd, env=env, check=True, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self) -> int:
        """SIGTERM to the whole session, SIGKILL to what is left once the role exited or the grace period
        passed; the role's exit code."""
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.process.pid, signal.SIGKILL)
        code = self.process.wait()
        self._pump.join(timeout=self.grace_s)
        return code


def _signal_group(group: int, sig: signal.Signals) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _copy_lines(stream, log_path: Path) -> None:
    with open(log_path, "ab") as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()
