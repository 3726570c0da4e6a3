"""The pacing controller of `buffer.max_staleness: auto`: the learner picks the staleness bound K during
the run from what its last steps measured.

K is worth raising while the learner waits for batches (generation is the bottleneck and letting it run
further ahead keeps the learner busy) and the off-policy drift of the batches it trains is small; it is
lowered when that drift grows past its bound. No group is ever dropped for how long it generated, so no
generation is wasted at any K: the drift is what a larger K costs. The decision is the pure
function `next_staleness`; `Pacer` feeds it the steps since K last changed. How K is applied to samples
stays in `asyncrl/staleness.py`; this module only chooses its value (rules and signals: docs/tuning.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

from asyncrl.config.buffer import PacingConfig

log = logging.getLogger(__name__)

WAIT_KEY, STEP_KEY = "timing_s/wait_batch", "timing_s/step"
KL_KEY, CLIP_KEY = "rollout_corr/mismatch_kl", "rollout_corr/is_clip_frac"


@dataclass(frozen=True)
class StepSignals:
    """What one learner step measured, as the controller reads it."""

    wait_s: float  # seconds the learner waited for the batch (timing_s/wait_batch)
    step_s: float  # seconds of the whole step (timing_s/step)
    mismatch_kl: float  # KL(π_behav‖π_learner) of the batch (rollout_corr/mismatch_kl)
    is_clip_frac: float  # share of trained tokens the correction truncated or masked (rollout_corr/is_clip_frac)

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> StepSignals:
        """The signals of a learner step's metrics record (the names in docs/metrics.md)."""
        return cls(wait_s=metrics[WAIT_KEY], step_s=metrics[STEP_KEY], mismatch_kl=metrics.get(KL_KEY, 0.0),
                   is_clip_frac=metrics.get(CLIP_KEY, 0.0))


@dataclass(frozen=True)
class WindowSummary:
    """The signals of several steps, summed or averaged."""

    wait_share: float  # waiting for batches / step time, over the window
    mismatch_kl: float  # mean over the window's steps
    is_clip_frac: float  # mean over the window's steps

    @classmethod
    def of(cls, steps: Sequence[StepSignals]) -> WindowSummary:
        step_s = sum(step.step_s for step in steps)
        return cls(wait_share=sum(step.wait_s for step in steps) / step_s if step_s > 0 else 0.0,
                   mismatch_kl=sum(step.mismatch_kl for step in steps) / len(steps),
                   is_clip_frac=sum(step.is_clip_frac for step in steps) / len(steps))

    def describe(self) -> str:
        return (f"wait {self.wait_share:.0%} of step time, mismatch_kl {self.mismatch_kl:.4f}, "
                f"is_clip_frac {self.is_clip_frac:.3f}")


@dataclass(frozen=True)
class Decision:
    k: int  # the bound for the next steps
    reason: str  # why, with the signals it read


def next_staleness(k: int, recent: Sequence[StepSignals], settings: PacingConfig) -> Decision:
    """K for the next steps, from the steps trained since K last changed (oldest first).

    Rules, first match wins: fewer than `window` steps → hold; drift above a bound → K − 1; the learner
    waited more than `raise_wait_share` and both drift signals are under `raise_headroom` of their bounds
    → K + 1; otherwise hold. K never leaves [k_min, k_max]."""
    if len(recent) < settings.window:
        return Decision(k, f"gathering: {len(recent)} of {settings.window} steps at K={k}")
    window = WindowSummary.of(recent[-settings.window:])
    signals = window.describe()
    waiting = window.wait_share > settings.raise_wait_share
    if window.mismatch_kl > settings.max_mismatch_kl or window.is_clip_frac > settings.max_is_clip_frac:
        return _lower(k, settings, f"drift above its bound (mismatch_kl ≤ {settings.max_mismatch_kl:g}, "
                                   f"is_clip_frac ≤ {settings.max_is_clip_frac:g}): {signals}")
    calm = (window.mismatch_kl <= settings.raise_headroom * settings.max_mismatch_kl
            and window.is_clip_frac <= settings.raise_headroom * settings.max_is_clip_frac)
    if waiting and calm:
        return _raise(k, settings, f"the learner waits for batches and drift is under {settings.raise_headroom:.0%} "
                                   f"of its bounds: {signals}")
    if waiting:
        return Decision(k, f"hold: the learner waits but drift leaves no room for another version: {signals}")
    return Decision(k, f"hold: {signals}")


def _lower(k: int, settings: PacingConfig, why: str) -> Decision:
    if k <= settings.k_min:
        return Decision(settings.k_min, f"hold at k_min={settings.k_min}: {why}")
    return Decision(k - 1, why)


def _raise(k: int, settings: PacingConfig, why: str) -> Decision:
    if k >= settings.k_max:
        return Decision(settings.k_max, f"hold at k_max={settings.k_max}: {why}")
    return Decision(k + 1, why)


class Pacer:
    """Keeps the steps since K last changed and applies `next_staleness` after each step; logs every change."""

    def __init__(self, settings: PacingConfig, k: int) -> None:
        self.settings = settings
        self.k = settings.clamp(k)  # a resumed K inside bounds that may have changed since
        self.recent: list[StepSignals] = []

    def observe(self, version: int, metrics: Mapping[str, float]) -> Decision:
        """Read the step that produced `version`; return the K for the next steps."""
        self.recent = [*self.recent, StepSignals.from_metrics(metrics)][-self.settings.window:]
        decision = next_staleness(self.k, self.recent, self.settings)
        if decision.k != self.k:
            log.info("pacing: max_staleness %d -> %d after step %d: %s", self.k, decision.k, version, decision.reason)
            self.k, self.recent = decision.k, []
        return decision


class FixedStaleness:
    """A fixed `buffer.max_staleness`, where no Pacer chooses K: every step keeps it."""

    def __init__(self, k: int) -> None:
        self.k = k

    def observe(self, version: int, metrics: Mapping[str, float]) -> Decision:
        return Decision(self.k, "buffer.max_staleness is fixed")
