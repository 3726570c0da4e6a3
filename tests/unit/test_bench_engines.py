"""Engines per GPU (scripts/bench_engines.py): each count's engines kept full by engine_ceiling.py with the samples in
flight split among them as the race's async job splits them, and every count's rate against the first's."""

import json

import pytest

from scripts import bench_engines

RACE = ["rollout.max_inflight=1536", "rollout.engine.cudagraph_max_sequences=1536"]


def ceiling_result(command: list[str]) -> dict:
    """What engine_ceiling.py would print for `command`: two engines 1.6x one's rate."""
    two = "rollout.num_servers=2" in command
    return {"ceiling_tokens_per_s": 32_000.0 if two else 20_000.0, "window_s": 30.0, "tokens": 1, "samples_finished": 9,
            "length_mean": 180.0, "max_inflight": 1536, "group_size": 8, "in_flight_at_end": 1530,
            "engine_start_s": 25.0, "max_tokens": 1024, **({"engines": 2, "engine_tokens_per_s": [16_100.0, 15_900.0]}
                                                          if two else {})}


def test_each_count_is_measured_as_the_async_job_splits_it_and_compared_with_the_first(monkeypatch, capsys):
    commands = []

    def measured(command, what, timeout_s=None, show_result=False):
        commands.append(command)
        return ceiling_result(command)

    monkeypatch.setattr(bench_engines, "result_of", measured)
    bench_engines.main(["--config", "configs/gpu_longtail.yaml", "--engines", "1,2", "--seconds", "20", *RACE])
    assert commands[0][-2:] == RACE  # one engine: the config's own settings
    assert commands[1][-5:] == [*RACE, "rollout.num_servers=2", "rollout.max_inflight=768",
                                "rollout.engine.cudagraph_max_sequences=768"]
    assert commands[1][commands[1].index("--seconds") + 1] == "20.0"
    out = capsys.readouterr().out
    assert "       2        768      32000  16100, 15900               180.0       25.0     1.60x" in out
    result = json.loads(out.splitlines()[-1][len("RESULT "):])
    assert (result["counts"], result["tokens_per_s"], result["speedups"]) == ([1, 2], [20_000.0, 32_000.0], [1.0, 1.6])
    assert [run["in_flight_each"] for run in result["runs"]] == [1536, 768]


def test_a_count_whose_measure_fails_ends_the_benchmark_naming_it(monkeypatch):
    def failed(command, what, timeout_s=None, show_result=False):
        raise SystemExit(f"{what}: engine_ceiling.py exited with 1")  # as result_of ends a failed child

    monkeypatch.setattr(bench_engines, "result_of", failed)
    with pytest.raises(SystemExit, match="1 engine\\(s\\): engine_ceiling.py exited with 1"):
        bench_engines.main(["--engines", "1"])


@pytest.mark.parametrize("engines", ["", "0,1", "2,-1"])
def test_counts_below_one_are_refused(engines):
    with pytest.raises(SystemExit):
        bench_engines.parse_args(["--engines", engines])
