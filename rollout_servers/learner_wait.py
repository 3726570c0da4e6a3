"""A server whose learner is gone (its buffer does not answer) waits for it instead of failing: it says so once
a minute and carries on when the learner is back (`learner.resume=auto`) at the same addresses. A learner that
comes back on other addresses, or has finished the job meanwhile, says so in the run's endpoints file; the
server then stops with the matching exit, and its supervisor restarts it on the new addresses or ends."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.endpoints import FINISHED_KEY, read_endpoints

log = logging.getLogger(__name__)

REPORT_EVERY_S = 60.0  # how often a waiting server says that it waits


@dataclass(frozen=True)
class Endpoints:
    """Where a server finds its learner."""

    buffer: str  # tcp:// address of the trajectory buffer
    sync: str  # tcp:// address of the learner's weight-sync coordinator
    learner_dir: Path | None = None  # the run directory whose endpoints file named them (None: fixed by the config)


class LearnerMoved(Exception):
    """The learner is back on other addresses than the server's: the server restarts on them."""


class LearnerFinished(Exception):
    """The learner finished the job while the server waited for it."""

    def __init__(self, version: int) -> None:
        super().__init__(f"the learner finished the job at step {version}")
        self.version = version


class LearnerWait:
    def __init__(self, buffer_address: str, sync_address: str, run_dir: Path | None,
                 report_every_s: float = REPORT_EVERY_S) -> None:
        """`run_dir`: where the learner writes its endpoints file (None: the addresses are fixed by the config,
        and only the learner's return there ends the wait)."""
        self.addresses = {"buffer": buffer_address, "sync": sync_address}
        self.run_dir, self.report_every_s = run_dir, report_every_s
        self._silent_since: float | None = None  # monotonic time of the first unanswered request of this wait
        self._reported_at: float | None = None  # monotonic time of this wait's last report (None: none yet)

    def silent(self, error: Exception) -> None:
        """A request to the buffer went unanswered (`error`): say once a minute that the server waits; raise
        LearnerMoved or LearnerFinished when the endpoints file says so."""
        now = time.monotonic()
        if self._silent_since is None:
            self._silent_since = now
        if self._reported_at is None or now - self._reported_at >= self.report_every_s:
            self._reported_at = now
            silent_for = f"for {now - self._silent_since:.0f}s" if now > self._silent_since else "(first time)"
            log.warning("waiting for the learner: its buffer at %s has not answered %s: %s; generation carries on "
                        "when it is back", self.addresses["buffer"], silent_for, error)
        found = read_endpoints(self.run_dir) if self.run_dir is not None else None
        if found is None:
            return
        if FINISHED_KEY in found:
            raise LearnerFinished(found[FINISHED_KEY])
        if {key: found.get(key) for key in self.addresses} != self.addresses:
            raise LearnerMoved(f"the learner is back at buffer {found.get('buffer')}, weight sync {found.get('sync')}")

    def answered(self) -> None:
        """The buffer answered: a wait, if there was one, is over."""
        if self._silent_since is not None:
            log.info("the learner's buffer answers again after %.0fs: carrying on", time.monotonic() - self._silent_since)
            self._silent_since, self._reported_at = None, None
