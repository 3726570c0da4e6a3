"""The staleness study's measurements of one cell, its rows over seeds, and how it spreads cells over GPUs, on
hand-written metrics records (no run)."""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time

import pytest

from scripts import staleness_study
from scripts.staleness_study import Cell, measure, run_cells, summarise


def step(number: int, staleness: int, kl: float, clip: float, time: float, masked: float | None = None) -> dict:
    record = {"step": number, "time": time, "batch/samples": 64.0, "staleness/mean": float(staleness),
              "staleness/min": float(staleness), "staleness/max": float(staleness), "rollout_corr/mismatch_kl": kl,
              "rollout_corr/is_clip_frac": clip, "rollout_corr/is_weight_mean": 1.0, "actor/pg_clipfrac": clip}
    if masked is not None:
        record["trust_region/masked_frac"] = masked
    return record


def test_drift_and_masking_are_averaged_over_the_steps_at_full_lag_and_staleness_over_all():
    # K = 2 over 4 steps: steps 1 and 2 train at versions 0 and 1 (staleness 0 and 1), steps 3 and 4 at lag 2
    records = [{"step": 0, "time": 0.0, "val/version": 0.0, "val/score/mean": 0.25},
               step(1, 0, 0.0, 0.0, 10.0, masked=0.9), step(2, 1, 0.1, 0.0, 11.0, masked=0.9),
               step(3, 2, 0.2, 0.5, 12.0, masked=0.1), step(4, 2, 0.4, 0.25, 14.0, masked=0.3),
               {"step": 4, "time": 15.0, "val/version": 4.0, "val/score/mean": 0.5}]
    measured = measure(records, k=2, steps=4)
    assert measured["mismatch_kl"] == pytest.approx(0.3) and measured["is_clip_frac"] == pytest.approx(0.375)
    assert measured["masked_frac"] == pytest.approx(0.2) and measured["pg_clipfrac"] == pytest.approx(0.375)
    assert (measured["staleness_min"], measured["staleness_max"]) == (2.0, 2.0)
    assert measured["staleness_mean"] == pytest.approx(5 / 4)
    assert (measured["val_start"], measured["val_score"]) == (0.25, 0.5)
    assert measured["samples_per_s"] == pytest.approx(3 * 64 / 4)  # steps 2-4 over the 4 s since step 1


def test_a_loss_without_a_mask_has_no_masked_fraction():
    assert measure([step(1, 0, 0.0, 0.0, 1.0), step(2, 0, 0.0, 0.0, 2.0)], k=0, steps=2)["masked_frac"] is None


def cell(k: int, seed: int, val_score: float, samples_per_s: float, mini_batches: int = 1) -> Cell:
    return Cell(k, "naive_ppo", mini_batches, seed, 4, [], val_start=0.1, val_score=val_score, mismatch_kl=0.01 * k,
                masked_frac=None, pg_clipfrac=0.0, is_clip_frac=0.0, is_weight_mean=1.0, staleness_mean=float(k),
                staleness_min=float(k), staleness_max=float(k), samples_per_s=samples_per_s, wall_s=60.0, returncode=0)


def test_rows_give_the_seed_mean_and_spread_the_gain_and_the_throughput_ratio_to_k0():
    rows = summarise([cell(0, 0, 0.4, 10.0), cell(0, 1, 0.6, 10.0), cell(4, 0, 0.3, 5.0), cell(4, 1, 0.5, 15.0)])
    assert [(r["k"], r["seeds"]) for r in rows] == [(0, [0, 1]), (4, [0, 1])]
    assert rows[1]["val_score"] == pytest.approx(0.4) and rows[1]["val_score_std"] == pytest.approx(0.1414, abs=1e-4)
    assert rows[1]["val_gain"] == pytest.approx(0.3)
    assert rows[1]["mismatch_kl"] == pytest.approx(0.04) and rows[1]["throughput_vs_k0"] == pytest.approx(1.0)


def test_mini_batch_counts_are_rows_of_their_own_with_their_own_k0_baseline():
    rows = summarise([cell(0, 0, 0.4, 10.0, mini_batches=1), cell(0, 0, 0.6, 20.0, mini_batches=4),
                      cell(8, 0, 0.5, 10.0, mini_batches=4)])
    assert [(r["k"], r["mini_batches"], r["val_score"]) for r in rows] == [(0, 1, 0.4), (0, 4, 0.6), (8, 4, 0.5)]
    assert rows[2]["throughput_vs_k0"] == pytest.approx(0.5)  # against M = 4's K = 0, not M = 1's


def study_args(tmp_path, **settings) -> argparse.Namespace:
    defaults = {"gpus": "", "jobs": 1, "stop_starting_after_s": 0.0, "out_dir": str(tmp_path), "steps": 4,
                "overrides": []}
    return argparse.Namespace(**{**defaults, **settings})


def test_cells_take_gpus_in_turn_and_never_two_cells_share_a_slot(tmp_path, monkeypatch):
    running: dict[str, int] = {}
    most: dict[str, int] = {}
    lock = threading.Lock()

    def fake_run(args, key, gpu):
        with lock:
            running[gpu] = running.get(gpu, 0) + 1
            most[gpu] = max(most.get(gpu, 0), running[gpu])
        time.sleep(0.05)
        with lock:
            running[gpu] -= 1
        return dataclasses.replace(cell(key[0], key[3], 0.5, 1.0), gpu=gpu)

    monkeypatch.setattr(staleness_study, "run_cell", fake_run)
    order = [(k, "naive_ppo", 1, seed) for seed in range(3) for k in (0, 8)]
    cells = run_cells(study_args(tmp_path, gpus="1,3", jobs=4), order)
    assert len(cells) == 6 and {c.gpu for c in cells} == {"1", "3"}
    assert most == {"1": 2, "3": 2}  # four jobs over two GPUs: two cells on each at most


def test_no_cell_starts_past_the_deadline(tmp_path, monkeypatch):
    def slow_run(args, key, gpu):
        time.sleep(0.3)
        return cell(key[0], key[3], 0.5, 1.0)

    monkeypatch.setattr(staleness_study, "run_cell", slow_run)
    order = [(k, "naive_ppo", 1, 0) for k in (0, 8, 16)]
    cells = run_cells(study_args(tmp_path, jobs=1, stop_starting_after_s=0.1), order)
    assert [c.k for c in cells] == [0]  # the first started at once; the others would start 0.3 s in
