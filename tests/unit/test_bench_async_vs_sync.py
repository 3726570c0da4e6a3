"""The async-vs-sync benchmark's summary: trained response tokens/s first, with the trained response length
against sync's and against the run's own generated one, then samples/s, over the timed steps."""

import argparse

import pytest

from scripts.bench_async_vs_sync import (Run, geometric_lengths, k_list, planned_runs, print_table, stop_token_ids, summarise,
                                         sweep_entry)


def test_summary_counts_the_timed_steps_only_and_weighs_tokens_by_response_length():
    # step 1 is warm-up (its end starts the clock); step 4, the last, pays for the final checkpoint
    records = [
        {"step": 1, "time": 10.0, "batch/samples": 8, "response_length/mean": 900.0, "buffer/dropped_stale": 3,
         "buffer/handed_out": 1, "timing_s/wait_batch": 9.0},
        {"step": 2, "time": 12.0, "batch/samples": 8, "response_length/mean": 100.0, "staleness/mean": 1.0,
         "staleness/max": 2, "buffer/dropped_stale": 4, "buffer/handed_out": 2, "timing_s/wait_batch": 0.5},
        {"step": 3, "time": 14.0, "batch/samples": 16, "response_length/mean": 400.0, "staleness/mean": 0.5,
         "staleness/max": 1, "buffer/dropped_stale": 6, "buffer/handed_out": 4, "timing_s/wait_batch": 1.5,
         "response_length/trained_vs_generated": 0.98},
        {"step": 4, "time": 30.0, "batch/samples": 8, "response_length/mean": 900.0, "buffer/dropped_stale": 9,
         "buffer/handed_out": 5, "timing_s/wait_batch": 16.0},
        {"step": 4, "time": 31.0, "val/score/mean": 0.5},  # not a training step
    ]
    summary = summarise(records, warmup_steps=1)
    assert summary["steps"] == 2
    assert summary["samples_per_s"] == pytest.approx((8 + 16) / 4.0)
    assert summary["trained_tokens_per_s"] == pytest.approx((8 * 100 + 16 * 400) / 4.0)
    assert summary["trained_vs_generated"] == 0.98  # the last timed step's: the buffer's counters are cumulative
    assert summary["staleness_mean"] == pytest.approx(0.75) and summary["staleness_max"] == 2
    # counters grow over steps 2-3 only: the warm-up's and the last step's drops and waits are not timed
    assert summary["groups_dropped_stale"] == 6 - 3 and summary["groups_handed_out"] == 4 - 1
    assert summary["learner_wait_share"] == pytest.approx((0.5 + 1.5) / 4.0)


def test_a_staleness_sweep_runs_sync_once_then_async_once_per_k_each_in_its_own_directory():
    runs = planned_runs(k_list("1,2,8"))
    assert [(run.mode, run.k) for run in runs] == [("sync", 1), ("async", 1), ("async", 2), ("async", 8)]
    assert [run.name for run in runs] == ["bench-sync", "bench-async-k1", "bench-async-k2", "bench-async-k8"]
    assert Run("async", 4).label == "async K=4"
    for bad in ("2,2", "-1", "a"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            k_list(bad)


def test_per_sample_lengths_stop_on_a_share_of_the_vocabulary_that_gives_the_median():
    vocab, median = 151_936, 192
    ids = stop_token_ids(vocab, median, seed=0)
    # P(stop) per token = 1 - 2^(-1/192) = 0.3604 %: 548 of 151,936 ids under a uniform next-token draw
    assert len(ids) == 548 and len(set(ids)) == 548 and all(0 <= i < vocab for i in ids)
    assert ids == stop_token_ids(vocab, median, seed=0) != stop_token_ids(vocab, median, seed=1)
    stats = geometric_lengths(median, max_tokens=1024, samples=20_000, seed=0)
    assert 180 <= stats["p50"] <= 205 and stats["max"] == 1024  # the cap holds the tail
    assert 250 <= stats["mean"] <= 285  # geometric mean 277 before the cap, a little less with it


def test_an_async_run_leaves_the_backlog_of_its_first_step_out_of_its_rate():
    # the first step compiles (14 s on an H100) while the server fills the buffer K + 1 batches ahead; the
    # next K steps drain it without waiting, so a K = 4 run is timed from step 6, a K = 2 run from step 4
    assert [run.warmup(3) for run in planned_runs(k_list("1,2,4,8"))] == [3, 3, 3, 5, 9]
    steps = [14.0, 0.5, 0.6, 0.8, 0.4, 2.6, 2.6, 2.6, 2.6, 2.6, 3.0]  # step_s of a K = 4 run, steps 1-11
    clock = [sum(steps[:i + 1]) for i in range(len(steps))]
    records = [{"step": i + 1, "time": t, "batch/samples": 128} for i, t in enumerate(clock)]
    assert summarise(records, Run("async", 4).warmup(3))["samples_per_s"] == pytest.approx(128 / 2.6)  # steps 6-10
    assert summarise(records, 3)["samples_per_s"] > 1.25 * 128 / 2.6  # what the backlog of steps 4-5 made of it


def test_the_headline_is_trained_tokens_with_the_length_ratio_against_sync_and_samples_second(capsys):
    sync = {"trained_tokens_per_s": 6000.0, "samples_per_s": 20.0, "response_length_mean": 300.0,
            "trained_vs_generated": None}
    async_run = {"trained_tokens_per_s": 9000.0, "samples_per_s": 40.0, "response_length_mean": 225.0,
                 "trained_vs_generated": 0.75, "staleness_mean": 1.5, "staleness_max": 3, "groups_dropped_stale": 0,
                 "groups_handed_out": 96, "learner_wait_share": 0.2, "steps": 6, "step_s": 3.2, "server_pause_ms": 50.0}
    entry = sweep_entry(Run("async", 2), async_run, sync)
    # 2x the samples but 1.5x the tokens: the responses trained are 25 % shorter than sync's
    assert (entry["trained_tokens_speedup"], entry["length_ratio"], entry["speedup"]) == (1.5, 0.75, 2.0)
    assert entry["trained_vs_generated"] == 0.75
    print_table({Run("sync", 2): sync | {k: v for k, v in async_run.items() if k not in sync},
                 Run("async", 2): async_run}, sync)
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    assert header.split()[:3] == ["run", "trained", "tok/s"]
    assert row.split()[2:8] == ["9000", "1.50x", "225.0", "0.75x", "0.750", "40.00"]
