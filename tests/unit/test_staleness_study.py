"""The staleness study's measurements of one cell and its rows over seeds, on hand-written metrics records."""

from __future__ import annotations

import pytest

from scripts.staleness_study import Cell, measure, summarise


def step(number: int, staleness: int, kl: float, clip: float, time: float) -> dict:
    return {"step": number, "time": time, "batch/samples": 64.0, "staleness/mean": float(staleness),
            "staleness/min": float(staleness), "staleness/max": float(staleness), "rollout_corr/mismatch_kl": kl,
            "rollout_corr/is_clip_frac": clip, "rollout_corr/is_weight_mean": 1.0}


def test_drift_is_averaged_over_the_steps_at_full_lag_and_staleness_over_all():
    # K = 2 over 4 steps: steps 1 and 2 train at versions 0 and 1 (staleness 0 and 1), steps 3 and 4 at lag 2
    records = [{"step": 0, "time": 0.0, "val/version": 0.0, "val/score/mean": 0.25},
               step(1, 0, 0.0, 0.0, 10.0), step(2, 1, 0.1, 0.0, 11.0), step(3, 2, 0.2, 0.5, 12.0),
               step(4, 2, 0.4, 0.25, 14.0), {"step": 4, "time": 15.0, "val/version": 4.0, "val/score/mean": 0.5}]
    measured = measure(records, k=2, steps=4)
    assert measured["mismatch_kl"] == pytest.approx(0.3) and measured["is_clip_frac"] == pytest.approx(0.375)
    assert (measured["staleness_min"], measured["staleness_max"]) == (2.0, 2.0)
    assert measured["staleness_mean"] == pytest.approx(5 / 4)
    assert (measured["val_start"], measured["val_final"]) == (0.25, 0.5)
    assert measured["samples_per_s"] == pytest.approx(3 * 64 / 4)  # steps 2-4 over the 4 s since step 1


def cell(k: int, seed: int, val_final: float, samples_per_s: float) -> Cell:
    return Cell(k, "naive_ppo", seed, 4, [], 0.1, val_final, 0.01 * k, 0.0, 1.0, float(k), float(k), float(k),
                samples_per_s, 60.0, 0)


def test_rows_give_the_seed_mean_and_spread_and_the_throughput_ratio_to_k0():
    rows = summarise([cell(0, 0, 0.4, 10.0), cell(0, 1, 0.6, 10.0), cell(4, 0, 0.3, 5.0), cell(4, 1, 0.5, 15.0)])
    assert [(r["k"], r["seeds"]) for r in rows] == [(0, [0, 1]), (4, [0, 1])]
    assert rows[1]["val_final"] == pytest.approx(0.4) and rows[1]["val_final_std"] == pytest.approx(0.1414, abs=1e-4)
    assert rows[1]["mismatch_kl"] == pytest.approx(0.04) and rows[1]["throughput_vs_k0"] == pytest.approx(1.0)
