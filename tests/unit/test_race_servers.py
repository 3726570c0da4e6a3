"""The race's async job with several servers on its GPUs (bench_time_to_score.py --async-servers): the samples it runs
at once split among them, each server's CUDA graphs no larger than its part, the runs named apart from one server's,
its engine settings prepared in vLLM's compile cache beside sync's, and the ceiling measured with as many engines."""

import argparse
import json
import pathlib
import subprocess
import sys

import pytest

from asyncrl.config import load_config
from scripts import bench_time_to_score
from scripts.bench_time_to_score import job_for, parse_args
from scripts.race_runs import Mode, servers_overrides

RACE = ["rollout.max_inflight=1536", "rollout.engine.cudagraph_max_sequences=1536"]  # the 600m shape's


@pytest.mark.parametrize(("servers", "graphs", "expected"), [
    (1, 1536, ()),
    (2, 1536, ("rollout.num_servers=2", "rollout.max_inflight=768", "rollout.engine.cudagraph_max_sequences=768")),
    (3, 1536, ("rollout.num_servers=3", "rollout.max_inflight=512", "rollout.engine.cudagraph_max_sequences=512")),
    (2, 512, ("rollout.num_servers=2", "rollout.max_inflight=768")),  # graphs within a server's part: kept
    (2, 0, ("rollout.num_servers=2", "rollout.max_inflight=768")),  # vLLM's own graphs
])
def test_the_samples_in_flight_are_split_among_the_servers(servers, graphs, expected):
    config = load_config("configs/gpu_longtail.yaml", [RACE[0], f"rollout.engine.cudagraph_max_sequences={graphs}"])
    assert servers_overrides(config, servers) == expected
    assert servers_overrides(load_config("configs/gpu_longtail.yaml", ["rollout.max_inflight=1537"]), 2)[1] == \
        "rollout.max_inflight=769"  # rounded up: never fewer slots in all than one server had


def test_several_servers_name_the_run_and_reach_the_async_job_alone_after_the_races_overrides(tmp_path):
    args = argparse.Namespace(config="configs/gpu_longtail.yaml", overrides=[*RACE], sync_ranks=0)
    two = Mode("async", 4, 2, servers_overrides(load_config(args.config, RACE), 2))
    assert (two.run_name(1), two.label) == ("tts-async-k4-2srv-s1", "async K=4, 2 servers")
    assert (Mode("async", 4).run_name(1), Mode("async", 4).label) == ("tts-async-k4-s1", "async K=4")
    async_, sync = job_for(two, 1, args, 100, 20, tmp_path, None), job_for(Mode("sync", 4), 1, args, 100, 20, tmp_path, None)
    assert async_.command[-5:] == [*RACE, *two.overrides]  # after the race's own: they win
    assert not any("num_servers" in part for part in sync.command)  # the synchronous run keeps its one engine per GPU


def test_the_preparation_starts_each_modes_engine_settings_once_and_the_ceiling_has_the_async_jobs(monkeypatch,
                                                                                                   tmp_path):
    commands = []
    monkeypatch.setattr(bench_time_to_score.subprocess, "run", lambda command, **_: commands.append(command)
                        or argparse.Namespace(returncode=0, stdout=""))
    args = parse_args(["--config", "configs/gpu_longtail.yaml", *RACE, "--async-servers", "2"])
    two = servers_overrides(load_config(args.config, RACE), 2)
    bench_time_to_score.prepare(args, False, [(), two, two])
    starts = [command for command in commands if pathlib.Path(command[1]).name == "engine_ceiling.py"]
    assert [command[command.index("--start-only") + 1:] for command in starts] == [RACE, RACE + list(two)]
    commands.clear()
    monkeypatch.setattr(bench_time_to_score, "result_of", lambda command, *_: commands.append(command))
    bench_time_to_score.measure_ceiling(args, tmp_path, two)
    assert commands[0][-len(two) - len(RACE):] == RACE + list(two)  # two engines kept full, as the async job runs them


def test_no_servers_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--async-servers", "0"])


def test_the_report_reads_how_many_engines_the_ceiling_kept_full(tmp_path):
    from scripts.run_records import CEILING_FILE, ceiling_engines

    assert ceiling_engines(tmp_path) is None  # none measured
    (tmp_path / CEILING_FILE).write_text('{"ceiling_tokens_per_s": 21003.0}')
    assert ceiling_engines(tmp_path) == 1  # measured before the key was kept: one engine
    (tmp_path / CEILING_FILE).write_text('{"ceiling_tokens_per_s": 38000.6, "engines": 2}')
    assert ceiling_engines(tmp_path) == 2


ONE_OF_TWO = "docs/data/time_to_score/race-2026-12-08-600m-h100-pace-2srv-k4-s0-one-joined.tar.gz"


def test_the_report_says_when_the_async_job_trained_with_fewer_servers_than_it_was_given(tmp_path):
    # the records of an H100 pace whose second server never joined (its GPU's start turn kept by the first one's
    # engine core): every timed step had one server alive
    done = subprocess.run([sys.executable, "scripts/bench_time_to_score.py", "--skip-prepare", "--modes", "", "--seeds",
                           "0", "--steps", "40", "--val-every", "20", "--max-staleness", "4", "--async-servers", "2",
                           "--out-dir", str(tmp_path), "--restore", ONE_OF_TWO],
                          capture_output=True, text=True, timeout=300, cwd=pathlib.Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the async job trained with 1 of its 2 server(s) at some step" in done.stdout
    result = json.loads(done.stdout.split("RESULT ")[-1])
    assert result["async_servers"] == 2
    assert (result["async"]["servers_serving"], result["sync"]["servers_serving"]) == (1, None)
