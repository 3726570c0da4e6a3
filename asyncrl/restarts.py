"""When to restart a supervised process that died, shared by `asyncrl rollout`'s supervisor, the learner's
watch over its own buffer and the Ray launcher: back-off doubling with each death in a row soon after a start,
a fresh count once a process has run `rollout.healthy_after_s`, and giving up past a restart limit (each caller
names its own: `rollout.max_restarts`, `buffer.max_restarts`, `ray.max_restarts`)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config.rollout import RolloutConfig


@dataclass
class QuickDeaths:
    healthy_after_s: float  # a death after running this long does not count towards giving up
    max_restarts: int  # restarts allowed in a row; the next quick death gives up
    backoff_s: float  # delay before the first restart of a row
    backoff_max_s: float  # longest delay
    in_a_row: int = 0  # deaths in a row, each within healthy_after_s of its start

    @classmethod
    def of(cls, rollout: RolloutConfig, max_restarts: int) -> QuickDeaths:
        return cls(rollout.healthy_after_s, max_restarts, rollout.restart_backoff_s, rollout.restart_backoff_max_s)

    def restart_delay(self, ran_s: float) -> float | None:
        """Count a death after `ran_s` seconds of running; the delay before the restart, or None: give up."""
        self.in_a_row = self.in_a_row + 1 if ran_s < self.healthy_after_s else 1
        if self.in_a_row > self.max_restarts:
            return None
        return min(self.backoff_s * 2 ** (self.in_a_row - 1), self.backoff_max_s)

    def describe(self) -> str:
        return f"death {self.in_a_row} in a row within rollout.healthy_after_s={self.healthy_after_s:g}s of its start"
