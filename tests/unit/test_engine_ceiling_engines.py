"""Several engines' ceiling (scripts/engine_ceiling.py with rollout.num_servers above 1): their figures add up to one
generation side's, each engine starts on its own turn through the prompts, and an engine that ends without its
figures, or sends nothing in time, ends the measure naming it."""

import multiprocessing
import time

import pytest

from scripts.engine_ceiling import combined, receive, rotated


def figures(rate: float, tokens: int, finished: int, length: float | None, in_flight: int, start_s: float) -> dict:
    return {"ceiling_tokens_per_s": rate, "window_s": 30.0, "tokens": tokens, "samples_finished": finished,
            "length_mean": length, "max_inflight": 768, "group_size": 8, "in_flight_at_end": in_flight,
            "engine_start_s": start_s, "max_tokens": 1024}


def test_two_engines_figures_are_one_generation_sides():
    result = combined([figures(20_000.4, 600_000, 300, 150.0, 760, 25.0), figures(18_000.2, 540_000, 100, 350.0, 766, 31.5)])
    assert result["ceiling_tokens_per_s"] == 38_000.6
    assert result["engine_tokens_per_s"] == [20_000.4, 18_000.2] and result["engines"] == 2
    assert (result["tokens"], result["samples_finished"], result["max_inflight"], result["in_flight_at_end"]) == \
        (1_140_000, 400, 1_536, 1_526)
    assert result["length_mean"] == (300 * 150.0 + 100 * 350.0) / 400  # over every finished sample: 200.0
    assert result["engine_start_s"] == 31.5  # the slowest start
    assert combined([figures(1.0, 30, 0, None, 8, 1.0)] * 2)["length_mean"] is None  # none finished


def test_each_engine_starts_its_own_part_of_the_prompts():
    prompts = [[i] for i in range(6)]
    assert [rotated(prompts, index, 3)[0] for index in range(3)] == [[0], [2], [4]]
    assert sorted(rotated(prompts, 2, 3)) == prompts  # every prompt, in turn


def exits_without_a_word() -> None:
    raise SystemExit(3)


def test_an_engine_that_ends_without_its_figures_or_sends_nothing_in_time_ends_the_measure_naming_it():
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=exits_without_a_word, name="engine-1")
    process.start()
    with pytest.raises(SystemExit, match="engine-1 exited with 3"):
        receive(process, ours, 60.0)
    silent = context.Process(target=time.sleep, args=(60,), name="engine-0")
    silent.start()
    try:
        with pytest.raises(SystemExit, match="engine-0 sent nothing in 1s"):
            receive(silent, ours, 1.0)
    finally:
        silent.kill()
        silent.join()
