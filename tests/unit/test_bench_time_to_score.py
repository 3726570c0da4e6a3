"""The time-to-score benchmark's reading of metrics: each mode's clock, the target, the time to reach it, trained
tokens/s, lengths and the held-out score per length bucket at equal steps, on hand-written records."""

import pytest

from scripts.bench_time_to_score import Mode, compare, mode_figures, passes, pick_target, summarise, time_to_target

LAUNCHED = 100.0


def step(number: int, time: float, step_s: float, length: float, **more) -> dict:
    return {"step": number, "time": time, "batch/samples": 8, "response_length/mean": length, "timing_s/step": step_s,
            **more}


def validated(version: int, score: float, seconds: float, **buckets: float) -> dict:
    return {"val/version": float(version), "val/score/mean": score, "val/seconds": seconds,
            **{f"val/score/bucket/{name.replace('_', '-')}": value for name, value in buckets.items()}}


# The reference validates between steps: version 0 before step 1 (5 s), versions 2 and 4 after their steps (4 s, 6 s).
SYNC = [
    {"step": 0, "time": 105.0, **validated(0, 0.4, 5.0)},
    step(1, 120.0, 15.0, 100.0),
    step(2, 144.0, 20.0, 200.0, **validated(2, 0.6, 4.0, **{"1_64": 0.7, "65_inf": 0.3})),
    step(3, 160.0, 16.0, 300.0),
    step(4, 183.0, 17.0, 400.0, **validated(4, 0.8, 6.0, **{"1_64": 0.9, "65_inf": 0.5})),
]
# The async job starts slower (its first record at 60 s), validates beside generation (passes arrive later, their
# seconds stay on its clock), and its last record waits 25 s for the final pass.
ASYNC = [
    step(1, 160.0, 10.0, 100.0, **validated(0, 0.4, 3.0)),
    step(2, 165.0, 5.0, 180.0),
    step(3, 170.0, 5.0, 280.0, **validated(2, 0.7, 8.0, **{"1_64": 0.8, "65_inf": 0.2})),
    step(4, 200.0, 5.0, 400.0, **{"response_length/generated_mean": 250.0},
         **validated(4, 0.85, 8.0, **{"1_64": 0.95, "65_inf": 0.5})),
    {"step": 4, "time": 201.0, **validated(4, 0.9, 8.0)},  # a second report of version 4: the first one counts
]


def test_the_reference_clock_leaves_out_its_validation_passes_and_a_version_counts_from_its_step_end():
    summary = summarise(SYNC, LAUNCHED, Mode("sync", 2), warmup_steps=1)
    # clock at steps 1-4: 120-100-5 = 15, 144-100-9 = 35, 160-100-9 = 51, 183-100-15 = 68
    assert summary["made_at"] == {0: 0.0, 2: 15.0 + 20.0, 4: 51.0 + 17.0}
    assert (summary["first_record_s"], summary["last_record_s"]) == (15.0, 68.0)
    assert summary["scores"] == {0: 0.4, 2: 0.6, 4: 0.8}
    # timed: steps 2-3 (after warm-up step 1, before the last), 8 x 200 + 8 x 300 tokens over 51 - 15 s
    assert summary["trained_tokens_per_s"] == pytest.approx(4000 / 36)
    assert summary["trained_length_mean"] == 250.0 and summary["length_ratio"] == 1.0  # it trains all it generates


def test_the_async_clock_keeps_its_passes_and_its_last_version_ends_before_the_final_wait():
    summary = summarise(ASYNC, LAUNCHED, Mode("async", 1), warmup_steps=1)
    # clock at steps 1-4: 60, 65, 70, 100; version 4 ended at 70 + 5, not at its record (100, after the wait)
    assert summary["made_at"] == {0: 0.0, 2: 60.0 + 5.0, 4: 70.0 + 5.0}
    assert summary["scores"] == {0: 0.4, 2: 0.7, 4: 0.85}
    # K = 1: warm-up max(1, K + 1) = 2 steps, so step 3 alone is timed: 8 x 280 tokens in 70 - 65 s
    assert summary["trained_tokens_per_s"] == pytest.approx(8 * 280 / 5.0)
    assert summary["trained_length_mean"] == pytest.approx(240.0)  # (100 + 180 + 280 + 400) / 4
    assert summary["length_ratio"] == pytest.approx(240.0 / 250.0)  # against the buffer's generated mean
    assert passes(ASYNC)[4]["val/score/mean"] == 0.85


def test_time_to_a_target_a_fraction_of_the_way_to_the_lower_best_and_the_buckets_at_equal_steps():
    sync = summarise(SYNC, LAUNCHED, Mode("sync", 1), warmup_steps=1)
    async_ = summarise(ASYNC, LAUNCHED, Mode("async", 1), warmup_steps=1)
    target = pick_target([sync, async_], None, 0.25)
    assert target == pytest.approx(0.4 + 0.25 * (0.8 - 0.4))  # starts 0.4 and 0.4, bests 0.8 and 0.85: 0.5
    assert time_to_target(sync, target) == (2, 35.0) and time_to_target(async_, target) == (2, 65.0)
    assert time_to_target(sync, 0.81) == (None, None) and time_to_target(async_, 0.81) == (4, 75.0)
    comparison = compare(sync, async_, target)
    assert comparison["time_to_score_speedup"] == round(35 / 65, 3)
    assert comparison["trained_tokens_speedup"] == round((8 * 280 / 5.0) / (4000 / 36), 3)
    assert comparison["length_vs_sync"] == round(240 / 250, 3)
    assert comparison["equal_step_version"] == 4
    assert comparison["buckets"] == {"1-64": {"sync": 0.9, "async": 0.95}, "65-inf": {"sync": 0.5, "async": 0.5}}
    assert comparison["every_bucket_at_least_sync"] is True
    figures = mode_figures(async_, target)
    assert (figures["time_to_target_s"], figures["version_at_target"], figures["best_score"]) == (65.0, 2, 0.85)


def test_an_explicit_target_wins_and_no_improvement_gives_no_target():
    sync = summarise(SYNC, LAUNCHED, Mode("sync", 1), warmup_steps=1)
    assert pick_target([sync], 0.75, 0.5) == 0.75
    flat = summarise([{**r, "val/score/mean": 0.4} if "val/score/mean" in r else r for r in SYNC], LAUNCHED,
                     Mode("sync", 1), warmup_steps=1)
    assert pick_target([flat], None, 0.8) is None and time_to_target(flat, None) == (None, None)


def test_modes_name_their_runs_and_the_async_warm_up_covers_its_backlog():
    assert [Mode("sync", 4).run_name, Mode("async", 4).run_name] == ["tts-sync", "tts-async-k4"]
    assert [Mode("sync", 4).warmup(3), Mode("async", 4).warmup(3), Mode("async", 1).warmup(3)] == [3, 5, 3]
    assert Mode("sync", 2).validation_stops_clock and not Mode("async", 2).validation_stops_clock
