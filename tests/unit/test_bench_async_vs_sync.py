"""The async-vs-sync benchmark's summary: samples/s and trained response tokens/s over the timed steps."""

import pytest

from scripts.bench_async_vs_sync import summarise


def test_summary_counts_the_timed_steps_only_and_weighs_tokens_by_response_length():
    # step 1 is warm-up (its end starts the clock); step 4, the last, pays for the final checkpoint
    records = [
        {"step": 1, "time": 10.0, "batch/samples": 8, "response_length/mean": 900.0},
        {"step": 2, "time": 12.0, "batch/samples": 8, "response_length/mean": 100.0, "staleness/mean": 1.0,
         "staleness/max": 2},
        {"step": 3, "time": 14.0, "batch/samples": 16, "response_length/mean": 400.0, "staleness/mean": 0.5,
         "staleness/max": 1},
        {"step": 4, "time": 30.0, "batch/samples": 8, "response_length/mean": 900.0},
        {"step": 4, "time": 31.0, "val/score/mean": 0.5},  # not a training step
    ]
    summary = summarise(records, warmup_steps=1)
    assert summary["steps"] == 2
    assert summary["samples_per_s"] == pytest.approx((8 + 16) / 4.0)
    assert summary["tokens_per_s"] == pytest.approx((8 * 100 + 16 * 400) / 4.0)
    assert summary["staleness_mean"] == pytest.approx(0.75) and summary["staleness_max"] == 2
