"""The pacing controller's decision: each rule on hand-built step signals, its bounds, and the Pacer's
window (the steps since K last changed)."""

import logging

import pytest

from asyncrl.config.buffer import PacingConfig
from learner.services.pacing import Pacer, StepSignals, WindowSummary, next_staleness

SETTINGS = PacingConfig(k_min=1, k_max=4, window=3, raise_wait_share=0.1, max_mismatch_kl=0.02, max_is_clip_frac=0.05,
                        raise_headroom=0.5)


def step(wait_s=0.0, step_s=1.0, kl=0.0, clip=0.0) -> StepSignals:
    return StepSignals(wait_s, step_s, kl, clip)


def test_window_summary_by_hand():
    # waits 0.5 + 0 + 1.0 of 1 + 2 + 3 s
    summary = WindowSummary.of([step(0.5, 1.0, 0.01, 0.02), step(0.0, 2.0, 0.02, 0.04), step(1.0, 3.0, 0.03, 0.0)])
    assert summary.wait_share == pytest.approx(1.5 / 6)
    assert summary.mismatch_kl == pytest.approx(0.02) and summary.is_clip_frac == pytest.approx(0.02)


def test_holds_until_a_full_window_of_steps_at_this_k():
    decision = next_staleness(2, [step(wait_s=0.9)] * 2, SETTINGS)
    assert decision.k == 2 and decision.reason.startswith("gathering: 2 of 3")


def test_raises_while_the_learner_waits_and_drift_is_calm():
    # waits 0.3 s of 1 s (30 % > 10 %); kl 0.005 ≤ 0.5 · 0.02 and clip 0.02 ≤ 0.5 · 0.05
    decision = next_staleness(2, [step(wait_s=0.3, kl=0.005, clip=0.02)] * 3, SETTINGS)
    assert decision.k == 3 and "waits" in decision.reason and "wait 30%" in decision.reason


def test_waiting_with_drift_near_its_bound_holds():
    decision = next_staleness(2, [step(wait_s=0.3, kl=0.015)] * 3, SETTINGS)  # 0.015 > 0.5 · 0.02, under 0.02
    assert decision.k == 2 and "no room" in decision.reason


@pytest.mark.parametrize("drift", [{"kl": 0.021}, {"clip": 0.06}])
def test_drift_above_either_bound_lowers_even_while_the_learner_waits(drift):
    decision = next_staleness(3, [step(wait_s=0.5, **drift)] * 3, SETTINGS)
    assert decision.k == 2 and decision.reason.startswith("drift above its bound")


def test_a_learner_bound_run_with_calm_drift_holds():
    assert next_staleness(3, [step(wait_s=0.05, kl=0.001)] * 3, SETTINGS).k == 3


def test_never_leaves_its_bounds():
    assert next_staleness(4, [step(wait_s=0.9)] * 3, SETTINGS).k == 4
    assert next_staleness(1, [step(kl=1.0)] * 3, SETTINGS).k == 1
    assert "k_min=1" in next_staleness(1, [step(kl=1.0)] * 3, SETTINGS).reason


def test_the_decision_reads_only_the_last_window_of_steps():
    old_drift = [step(kl=1.0)] * 5
    assert next_staleness(2, old_drift + [step(wait_s=0.5)] * 3, SETTINGS).k == 3


def metrics(wait_s: float, kl: float = 0.0) -> dict[str, float]:
    return {"timing_s/wait_batch": wait_s, "timing_s/step": 1.0, "rollout_corr/mismatch_kl": kl,
            "rollout_corr/is_clip_frac": 0.0, "batch/samples": 32.0}


def test_pacer_reads_metric_records_and_starts_a_new_window_after_a_change(caplog):
    pacer = Pacer(SETTINGS, k=1)
    assert StepSignals.from_metrics(metrics(0.5, kl=0.01)) == StepSignals(0.5, 1.0, 0.01, 0.0)
    with caplog.at_level(logging.INFO, logger="learner.services.pacing"):
        ks = [pacer.observe(version, metrics(0.5)).k for version in range(1, 8)]
    # a change after each full window of 3 steps at the new K: 1, 1, 2 | 2, 2, 3 | 3
    assert ks == [1, 1, 2, 2, 2, 3, 3]
    changes = [record.getMessage() for record in caplog.records if "->" in record.getMessage()]
    assert len(changes) == 2 and changes[0].startswith("pacing: max_staleness 1 -> 2 after step 3: the learner waits")


def test_pacer_clamps_a_resumed_k_into_bounds_that_changed():
    assert Pacer(SETTINGS, k=7).k == 4
    assert Pacer(SETTINGS, k=0).k == 1
