"""When to restart a supervised process that died, shared by `asyncrl rollout`'s supervisor, the learner's
watch over its own buffer and the Ray launcher: back-off doubling with each death in a row soon after a start,
a fresh count once a process has run `rollout.healthy_after_s`, and giving up past a restart limit (each caller
names its own: `rollout.max_restarts`, `buffer.max_restarts`, `ray.max_restarts`), or at once when the same error
ended `SAME_ERROR_DEATHS` quick deaths in a row: a process that fails alike at each start (an engine that cannot
run the model) would fail alike at every restart, and the back-off would only hide the reason for minutes.
`QuickDeaths.next_restart` is the verdict the rollout supervisor and the Ray launcher share: the delay, or their
own exception saying why the process is not restarted again."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config.rollout import RolloutConfig

SAME_ERROR_DEATHS = 2  # quick deaths in a row ended by the same error that end the restarts (the first may be a fluke)


@dataclass(frozen=True)
class GiveUp:
    """How a supervisor names a process it stops restarting: the exceptions it raises and what their messages cite."""

    who: str  # the process, e.g. "server-0"
    limit_key: str  # the config key of its restart limit, e.g. "rollout.max_restarts"
    log: str | Path  # where the process logged why it died
    cannot_run: type[Exception]  # raised when the same error ended its last quick deaths: every start would meet it
    keeps_dying: type[Exception]  # raised past the restart limit


@dataclass
class QuickDeaths:
    healthy_after_s: float  # a death after running this long does not count towards giving up
    max_restarts: int  # restarts allowed in a row; the next quick death gives up
    backoff_s: float  # delay before the first restart of a row
    backoff_max_s: float  # longest delay
    in_a_row: int = 0  # deaths in a row, each within healthy_after_s of its start
    last_error: str | None = None  # what ended the last death (`error_signature`), None when unknown
    same_error: int = 0  # quick deaths in a row ended by `last_error`

    @classmethod
    def of(cls, rollout: RolloutConfig, max_restarts: int) -> QuickDeaths:
        return cls(rollout.healthy_after_s, max_restarts, rollout.restart_backoff_s, rollout.restart_backoff_max_s)

    def restart_delay(self, ran_s: float, error: str | None = None) -> float | None:
        """Count a death after `ran_s` seconds of running, ended by `error` (its `error_signature`, None when
        unknown); the delay before the restart, or None: give up (`describe` says why)."""
        quick = ran_s < self.healthy_after_s
        self.in_a_row = self.in_a_row + 1 if quick else 1
        repeated = quick and error is not None and error == self.last_error
        self.same_error = self.same_error + 1 if repeated else int(quick)  # a healthy run's death starts no count
        self.last_error = error
        if self.in_a_row > self.max_restarts or self.error_repeats:
            return None
        return min(self.backoff_s * 2 ** (self.in_a_row - 1), self.backoff_max_s)

    def next_restart(self, ran_s: float, error: str | None, ended: str, give_up: GiveUp) -> float:
        """Count a death (`restart_delay`) and return the delay before the restart, or raise `give_up`'s exception:
        `cannot_run` when the same error repeats, `keeps_dying` past the limit. `ended` says how the process ended
        (e.g. "last exit code 1")."""
        delay = self.restart_delay(ran_s, error)
        if self.error_repeats:
            raise give_up.cannot_run(f"{give_up.who} cannot run this config or install (not restarted again): "
                                     f"{self.describe()}; see {give_up.log}")
        if delay is None:
            raise give_up.keeps_dying(f"{give_up.who} keeps dying: {self.describe()} ({ended}; "
                                      f"{give_up.limit_key}={self.max_restarts}); see {give_up.log}")
        return delay

    @property
    def error_repeats(self) -> bool:
        """The same known error ended the last `SAME_ERROR_DEATHS` quick deaths: a restart would meet it again."""
        return self.last_error is not None and self.same_error >= SAME_ERROR_DEATHS

    def describe(self) -> str:
        if self.error_repeats:
            return (f"the same error ended {self.same_error} starts in a row, each within rollout.healthy_after_s="
                    f"{self.healthy_after_s:g}s: {self.last_error}")
        return f"death {self.in_a_row} in a row within rollout.healthy_after_s={self.healthy_after_s:g}s of its start"


def error_signature(error: BaseException) -> str:
    """What names an error, the same at each start that fails alike: its type and message, without the traceback
    (whose frames hold nothing that differs, but make a console line unreadable)."""
    return "".join(traceback.format_exception_only(error)).strip()
