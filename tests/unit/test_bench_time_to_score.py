"""The race to a score's reading of runs: each run's curve (version, when the learner made it, its score), trained
tokens/s and learner share, the seeds' mean curve, the target, the time to it, skipped validations and the buckets
at equal steps, on hand-written records."""

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from asyncrl.config import load_config, save_config
from asyncrl.learner_plan import LearnerPlan, read_plan, write_plan
from asyncrl.snapshots import made_times, read_evaluation
from scripts.bench_time_to_score import gpu_halves, job_for, parse_args, sync_baseline
from scripts.race_runs import Mode, missing_scores, read_runs, summarise
from scripts.race_figures import (ceiling_figures, equal_step_buckets, mean_curve, mode_figures, modes_match,
                                  pick_target, seconds_per_version, seed_speedups, time_to_target)
from scripts import run_records
from scripts.run_records import (add_log_readings, archive_records, cpu_shares, cpu_ticks, engine_begins, engine_start,
                                 host_facts, machine_of, read_ceiling, read_launch, restore_records, write_launch)

LAUNCHED = 100.0


def step(number: int, time: float, step_s: float, train_s: float, length: float, **more) -> dict:
    return {"step": number, "time": time, "batch/samples": 8, "response_length/mean": length, "timing_s/step": step_s,
            "timing_s/train": train_s, **more}


def scored(version: int, score: float, **buckets: float) -> dict:
    return {"version": version, "val/score/mean": score,
            **{f"val/score/bucket/{name.replace('_', '-')}": value for name, value in buckets.items()}}


INGESTED = "buffer/ingested_response_tokens"
SYNC = [step(1, 120.0, 15.0, 3.0, 100.0), step(2, 144.0, 20.0, 5.0, 200.0), step(3, 160.0, 16.0, 4.0, 300.0),
        step(4, 183.0, 17.0, 8.5, 400.0)]
SYNC_MADE = {0: 104.0, 2: 143.0, 4: 182.0}  # Unix times the snapshots were made (the launch at 100)
SYNC_SCORES = {0: scored(0, 0.4), 2: scored(2, 0.6, **{"1_64": 0.7, "65_inf": 0.3}),
               4: scored(4, 0.8, **{"1_64": 0.9, "65_inf": 0.5})}
ASYNC = [step(1, 160.0, 10.0, 2.0, 100.0), step(2, 165.0, 5.0, 2.0, 180.0, **{INGESTED: 4000.0}),
         step(3, 170.0, 5.0, 2.0, 280.0),
         step(4, 175.0, 5.0, 2.0, 400.0, **{"response_length/generated_mean": 250.0, INGESTED: 7000.0})]
ASYNC_MADE = {0: 150.0, 2: 164.0, 4: 174.5}
ASYNC_SCORES = {0: scored(0, 0.4), 2: scored(2, 0.7, **{"1_64": 0.8, "65_inf": 0.2}),
                4: scored(4, 0.85, **{"1_64": 0.95, "65_inf": 0.5})}


def sync_run() -> dict:
    return summarise(SYNC, SYNC_MADE, SYNC_SCORES, LAUNCHED, Mode("sync", 1), warmup_steps=1)


def async_run() -> dict:
    return summarise(ASYNC, ASYNC_MADE, ASYNC_SCORES, LAUNCHED, Mode("async", 1), warmup_steps=1)


def test_overrides_may_come_before_and_after_the_options_and_a_restore_takes_only_its_files(tmp_path, capsys):
    archives = [str(tmp_path / name) for name in ("a.tar.gz", "b.tar.gz")]
    for archive in archives:
        pathlib.Path(archive).touch()
    # as scripts/gpu_bench.sh calls it: the shape's overrides, then RACE_ARGS with a --restore among its options
    args = parse_args(["--modes", "sync", "model.tiny.num_layers=24", "metrics.wandb_mode=disabled",
                       "--restore", *archives, "--steps", "100", "optim.lr=1e-5"])
    assert args.restore == archives and args.steps == 100
    assert args.overrides == ["model.tiny.num_layers=24", "metrics.wandb_mode=disabled", "optim.lr=1e-5"]
    with pytest.raises(SystemExit):
        parse_args(["--restore", *archives, "optim.lr=1e-5"])
    assert "--restore optim.lr=1e-5: no such file" in capsys.readouterr().err


def test_a_run_reads_its_curve_from_the_snapshots_made_times_and_its_rate_after_the_warm_up():
    run = sync_run()
    assert run["curve"] == [(0, 4.0, 0.4), (2, 43.0, 0.6), (4, 82.0, 0.8)]
    # timed: steps 2-4 (after warm-up step 1), 8 x (200 + 300 + 400) tokens over 183 - 120 s
    assert run["trained_tokens_per_s"] == pytest.approx(8 * 900 / 63)
    assert run["time_per_step_s"] == pytest.approx(63 / 3)  # steps 2-4 between the records of steps 1 and 4
    assert run["learner_share"] == pytest.approx((5 / 20 + 4 / 16 + 8.5 / 17) / 3)
    assert run["training_tokens_per_s"] == pytest.approx(8 * 900 / (5 + 4 + 8.5))  # per second of training
    assert run["trained_length_mean"] == 250.0 and run["length_ratio"] == 1.0  # it trains all it generates
    assert run["generated_tokens_per_s"] == run["trained_tokens_per_s"]


def test_the_fewest_servers_alive_at_a_timed_step_are_read_and_the_warm_up_is_left_out():
    alive = [dict(record, **{"rollout/servers": count}) for record, count in zip(ASYNC, (1.0, 2.0, 2.0, 2.0))]
    run = summarise(alive, ASYNC_MADE, ASYNC_SCORES, LAUNCHED, Mode("async", 1, servers=2), warmup_steps=1)
    assert run["servers_serving"] == 2  # step 1's one server was before the timed steps (3-4)
    alive[2]["rollout/servers"] = 1.0  # one left at step 3
    one_left = summarise(alive, ASYNC_MADE, ASYNC_SCORES, LAUNCHED, Mode("async", 1, servers=2), warmup_steps=1)
    assert one_left["servers_serving"] == 1
    assert sync_run()["servers_serving"] is None  # sync has no servers
    assert mode_figures([run, one_left], run["curve"], None)["servers_serving"] == 1  # the fewest over the seeds
    assert mode_figures([sync_run()], sync_run()["curve"], None)["servers_serving"] is None


def test_the_async_warm_up_covers_its_backlog_and_its_lengths_compare_with_what_it_generated():
    run = async_run()
    # K = 1: warm-up max(1, K + 1) = 2 steps, so steps 3-4 are timed: 8 x (280 + 400) tokens in 175 - 165 s
    assert run["trained_tokens_per_s"] == pytest.approx(8 * 680 / 10.0)
    assert run["time_per_step_s"] == pytest.approx(10.0 / 2)  # steps 3-4 between the records of steps 2 and 4
    assert run["generated_tokens_per_s"] == pytest.approx(3000 / 10.0)  # stored 7,000 - 4,000 tokens meanwhile
    assert summarise(ASYNC[:3] + [step(4, 175.0, 5.0, 2.0, 400.0)], ASYNC_MADE, ASYNC_SCORES, LAUNCHED,
                     Mode("async", 1), warmup_steps=1)["generated_tokens_per_s"] is None  # a step without the count
    assert run["trained_length_mean"] == pytest.approx(240.0)  # (100 + 180 + 280 + 400) / 4
    assert run["length_ratio"] == pytest.approx(240.0 / 250.0)  # against the buffer's generated mean
    assert run["curve"][-1] == (4, 74.5, 0.85)


def test_the_seeds_mean_curve_keeps_the_versions_every_seed_scored():
    one, two = [(0, 0.0, 0.4), (2, 40.0, 0.6), (4, 80.0, 0.8)], [(0, 0.0, 0.4), (2, 50.0, 0.7)]
    assert mean_curve([one, two]) == [(0, 0.0, 0.4), (2, 45.0, pytest.approx(0.65))]


def test_the_target_is_a_fraction_of_the_way_to_the_lower_best_and_each_mode_reaches_it_when_made():
    sync, async_ = sync_run(), async_run()
    target = pick_target([sync["curve"], async_["curve"]], None, 0.9)
    assert target == pytest.approx(0.4 + 0.9 * (0.8 - 0.4))  # starts 0.4, bests 0.8 and 0.85: 0.76
    assert time_to_target(sync["curve"], target) == (4, 82.0)
    assert time_to_target(async_["curve"], target) == (4, 74.5)
    assert time_to_target(sync["curve"], 0.81) == (None, None)
    assert mode_figures([sync], sync["curve"], 0.81)["time_to_target_after_start_up_s"] is None  # never reached
    figures = mode_figures([async_], async_["curve"], target)
    assert (figures["time_to_target_s"], figures["version_at_target"], figures["best_score"]) == (74.5, 4, 0.85)
    assert (figures["start_up_s"], figures["time_to_target_after_start_up_s"]) == (50.0, 24.5)  # version 0 at 50 s
    assert figures["seed_times_to_target_s"] == [74.5] and figures["final_score"] == 0.85
    assert figures["final_score_sd"] is None  # one seed: no spread
    assert figures["curves"] == [[[0, 50.0, 0.4], [2, 64.0, 0.7], [4, 74.5, 0.85]]]
    assert figures["time_per_version_s"] == pytest.approx((74.5 - 50.0) / 4)  # the pace, start-up left out
    assert mode_figures([sync, async_], sync["curve"], target)["time_per_version_s"] == pytest.approx(
        ((82.0 - 4.0) / 4 + (74.5 - 50.0) / 4) / 2, abs=1e-3)  # the seeds' mean, to 3 decimals
    assert seconds_per_version([(0, 5.0, 0.4)]) is None  # one version: no pace


def test_each_seed_races_to_its_own_target_where_the_pooled_one_is_above_a_seed_s_curve():
    # seed 0 starts at 0.4 and levels off at 0.6; seed 1 starts at 0.5 and rises to 0.9
    sync = [{"seed": 0, "curve": [(0, 100.0, 0.4), (10, 200.0, 0.58), (20, 300.0, 0.6)]},
            {"seed": 1, "curve": [(0, 100.0, 0.5), (10, 200.0, 0.7), (20, 300.0, 0.9)]}]
    async_ = [{"seed": 1, "curve": [(0, 90.0, 0.5), (10, 120.0, 0.9), (20, 150.0, 0.9)]},
              {"seed": 0, "curve": [(0, 90.0, 0.4), (10, 120.0, 0.6), (20, 150.0, 0.6)]}]
    pooled = pick_target([mean_curve([run["curve"] for run in sync]), mean_curve([run["curve"] for run in async_])],
                         None, 0.9)
    assert pooled == pytest.approx(0.45 + 0.9 * (0.75 - 0.45))  # 0.72: above all of seed 0's curve
    # seed 0: target 0.4 + 0.9 * 0.2 = 0.58, sync at 200 s and async at 120 s; seed 1: 0.86, 300 s and 120 s
    assert seed_speedups(sync, async_, None, 0.9) == {"0": round(200 / 120, 3), "1": 2.5}
    assert seed_speedups(sync, async_[:1], 0.65, 0.9) == {"1": round(200 / 120, 3)}  # an explicit target; seed 1 alone
    stalled = [{"seed": 0, "curve": [(0, 90.0, 0.4), (10, 120.0, 0.4)]}]
    assert seed_speedups(sync, stalled, None, 0.9) == {"0": None}  # async never rose: no race on that seed


def test_an_explicit_target_wins_and_a_mode_that_never_improves_gives_none():
    curve = sync_run()["curve"]
    assert pick_target([curve], 0.75, 0.5) == 0.75
    flat = [(v, t, 0.4) for v, t, _ in curve]
    assert pick_target([curve, flat], None, 0.9) is None and time_to_target(flat, None) == (None, None)


def test_a_due_version_without_a_score_counts_as_skipped():
    assert missing_scores(SYNC_SCORES, SYNC_MADE, every=2, steps=4, scoring=True) == (0, 0)
    two_scored = {0: SYNC_SCORES[0], 4: SYNC_SCORES[4]}
    assert missing_scores(two_scored, SYNC_MADE, every=2, steps=4, scoring=True) == (1, 0)  # version 2
    assert missing_scores(SYNC_SCORES, SYNC_MADE, every=2, steps=5, scoring=True) == (1, 0)  # the final 5 is due too


def recorded_run(root: pathlib.Path, name: str, steps: int, snapshots: list[int]) -> None:
    """A finished run's records in `root`: launched for `steps` steps, its metrics, the `snapshots` it made."""
    write_launch(root, name, "ab12", 1, steps)
    (root / name / "snapshots").mkdir(parents=True)
    (root / name / "metrics.jsonl").write_text("".join(
        json.dumps(step(n, LAUNCHED + 5 * n, 5.0, 1.0, 100.0)) + "\n" for n in range(1, steps + 1)))
    (root / name / "snapshots" / "made.jsonl").write_text("".join(
        json.dumps({"version": v, "made_at": LAUNCHED + 5 * v}) + "\n" for v in snapshots))


def test_a_pace_s_shorter_sync_run_is_held_to_its_own_steps_s_due_validations(tmp_path):
    sync, async_ = Mode("sync", 0), Mode("async", 4)
    recorded_run(tmp_path, sync.run_name(0), 20, [0, 20])  # a pace: sync for 20 steps, async for 40
    recorded_run(tmp_path, async_.run_name(0), 40, [0, 20, 40])
    ran = {sync: [0], async_: [0]}
    records = read_runs(tmp_path, [sync, async_], ran, steps=40, val_every=20, scoring=False, warmup_steps=1)
    assert (records.skipped, records.unscored) == (0, 5)  # sync's version 40 was never due
    recorded_run(tmp_path, "tts-sync-s1", 20, [0])  # a run that stopped before its version 20
    records = read_runs(tmp_path, [sync], {sync: [1]}, steps=40, val_every=20, scoring=False, warmup_steps=1)
    assert (records.skipped, records.unscored) == (1, 1)


def test_a_snapshot_left_for_a_later_scoring_is_unscored_not_skipped():
    assert missing_scores({}, SYNC_MADE, every=2, steps=4, scoring=False) == (0, 3)  # a --no-evaluate call's report
    assert missing_scores({}, {0: 104.0, 4: 182.0}, every=2, steps=4, scoring=False) == (1, 2)  # 2 never snapshotted
    assert missing_scores({}, SYNC_MADE, every=2, steps=4, scoring=True) == (3, 0)  # a scoring that failed


def test_the_buckets_at_the_last_version_every_run_scored():
    version, buckets = equal_step_buckets([sync_run()], [async_run()])
    assert version == 4
    assert buckets == {"1-64": {"sync": 0.9, "async": 0.95}, "65-inf": {"sync": 0.5, "async": 0.5}}


def test_modes_name_their_runs_by_seed():
    assert [Mode("sync", 4).run_name(0), Mode("async", 4).run_name(2)] == ["tts-sync-s0", "tts-async-k4-s2"]
    assert [Mode("sync", 4).warmup(3), Mode("async", 4).warmup(3), Mode("async", 1).warmup(3)] == [3, 5, 3]


def test_the_ceiling_compares_the_engine_kept_full_with_both_modes_trained_tokens():
    no_turns = {"turns_tokens_per_s": None, "turns_speedup": None, "async_share_of_turns": None}
    assert ceiling_figures(30_000.0, 7_500.0, 21_000.0) == {
        "ceiling_tokens_per_s": 30_000.0, "ceiling_speedup": 4.0, "async_share_of_ceiling": 0.7, **no_turns}
    assert ceiling_figures(None, 7_500.0, 21_000.0, 20_000.0) == {
        "ceiling_tokens_per_s": None, "ceiling_speedup": None, "async_share_of_ceiling": None, **no_turns}
    # one GPU: generation at 30,000 tokens/s and training at 20,000 taking turns, 1 / (1/30,000 + 1/20,000) = 12,000
    # tokens/s; async at 13,200 overlapped the two sides by 10 %
    turns = ceiling_figures(30_000.0, 7_500.0, 13_200.0, 20_000.0)
    assert (turns["turns_tokens_per_s"], turns["turns_speedup"], turns["async_share_of_turns"]) == (12_000.0, 1.6, 1.1)


def test_archived_records_come_back_into_another_directory_without_the_weights(tmp_path):
    made = tmp_path / "made"
    run = made / "tts-sync-s2"
    (run / "snapshots").mkdir(parents=True)
    (run / "config.yaml").write_text("run:\n  seed: 2\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 5.0}) + "\n")
    (run / "snapshots" / "made.jsonl").write_text(json.dumps({"version": 0, "made_at": 3.5}) + "\n")
    (run / "snapshots" / "v0.pt").write_bytes(b"weights")
    (run / "evaluation.jsonl").write_text(json.dumps({"version": 0, "val/score/mean": 0.4}) + "\n")
    write_plan(run, LearnerPlan(micro_batch_tokens=20480, packed=True, activation_checkpointing="none"))
    (made / "tts-sync-s2.launch.json").write_text(json.dumps({"time": 1.0, "gpus": 1}))
    (made / "ceiling.json").write_text(json.dumps({"ceiling_tokens_per_s": 25_000.0}))
    (made / "unrelated.log").write_text("left out")
    archive = tmp_path / "records.tar.gz"
    archive.write_bytes(b"an archive of the runs so far")
    archive_records(made, archive)  # again, after another run: replaced whole, nothing left beside
    assert sorted(path.name for path in tmp_path.iterdir()) == ["made", "records.tar.gz"]
    assert not list(made.glob("*.part"))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    restore_records([str(archive)], elsewhere)
    back = elsewhere / "tts-sync-s2"
    assert made_times(back) == {0: 3.5} and read_evaluation(back)[0]["val/score/mean"] == 0.4
    assert (back / "config.yaml").read_text() == "run:\n  seed: 2\n"
    assert read_plan(back).activation_checkpointing == "none"  # what `asyncrl tune` reads of the resolved `auto`
    assert (back / "metrics.jsonl").is_file() and (elsewhere / "tts-sync-s2.launch.json").is_file()
    assert read_ceiling(elsewhere) == 25_000.0
    assert not (back / "snapshots" / "v0.pt").exists() and not (elsewhere / "unrelated.log").exists()
    assert read_ceiling(tmp_path) is None


@pytest.mark.parametrize(("gpus", "sync_ranks", "expected"), [
    (0, 1, "cpu"), (1, 1, "colocated_one_gpu"), (2, 1, "engine_and_learner_on_gpus_apart"),
    (2, 2, "colocated_all_gpus"), (4, 4, "colocated_all_gpus"), (4, 2, "colocated_some_gpus"),
])
def test_the_synchronous_baseline_is_named_by_the_gpus_and_the_ranks_it_ran(tmp_path, gpus, sync_ranks, expected):
    save_config(load_config(None, ["learner.mode=synchronous", f"learner.nproc={sync_ranks}", "buffer.batch_groups=4"]),
                tmp_path)
    assert sync_baseline(gpus, tmp_path) == expected


def test_the_engine_start_is_the_slowest_engine_s_first_start_from_the_roles_that_own_one(tmp_path):
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    line = "12:00:00 [rollout0] INFO rollout_servers.engine: vLLM engine on /m started in {}s (version 0)\n"
    (logs / "rollout0.log").write_text(line.format(21.5) + line.format(9.0))  # then a restart: left out
    (logs / "rollout1.log").write_text(line.format(24.0))
    (logs / "rollout.log").write_text(line.format(99.0))  # the supervisor's copy of its servers' lines
    assert engine_start(tmp_path / "run") == 24.0
    for log in logs.iterdir():
        log.unlink()
    (logs / "reference0.log").write_text(line.format(61.2).replace("rollout0", "reference0"))
    assert engine_start(tmp_path / "run") == 61.2  # the synchronous run's engine, in its rank's process
    (logs / "reference0.log").unlink()
    assert engine_start(tmp_path / "run") is None


def test_the_engine_begins_its_start_seconds_after_the_launch_by_its_log_lines_clock(tmp_path):
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    line = "{} [rollout0] INFO rollout_servers.engine: vLLM engine on /m started in {}s (version 0)\n"
    launched = time.mktime((2026, 12, 4, 19, 18, 0, 0, 0, -1))  # 19:18:00 local
    (logs / "rollout0.log").write_text(line.format("19:19:00", 13.0) + line.format("19:30:00", 9.0))  # then a restart
    (logs / "rollout1.log").write_text(line.format("19:18:40", 12.5))
    assert engine_begins(tmp_path / "run", launched + 0.4) == 46.6  # the last to begin: 60 - 13.0 - 0.4
    late = time.mktime((2026, 12, 4, 23, 59, 50, 0, 0, -1))
    (logs / "rollout1.log").unlink()
    (logs / "rollout0.log").write_text(line.format("00:00:20", 5.0))  # past midnight
    assert engine_begins(tmp_path / "run", late) == 25.0
    (logs / "rollout0.log").unlink()
    assert engine_begins(tmp_path / "run", late) is None


def test_a_finished_run_s_launch_file_says_when_its_engine_started_and_whether_it_ran_under_mps(tmp_path):
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "rollout0.log").write_text("12:00:30 [rollout0] INFO rollout_servers.engine: vLLM engine on /m started in "
                                       "20.0s (version 0)\n")
    launch = write_launch(tmp_path, "run", "abc", gpus=1, steps=4)
    add_log_readings(tmp_path, "run", launch)
    assert read_launch(tmp_path, "run")["under_mps"] is False and read_launch(tmp_path, "run")["engine_start_s"] == 20.0
    (logs / "mps").mkdir()
    (logs / "mps" / "control.log").write_text("started\n")  # a daemon that served no client: not MPS
    add_log_readings(tmp_path, "run", launch)
    assert read_launch(tmp_path, "run")["under_mps"] is False
    (logs / "mps" / "serving").write_text("4242\n")  # written once the job saw an MPS server serve its roles
    add_log_readings(tmp_path, "run", launch)
    assert read_launch(tmp_path, "run")["under_mps"] is True and read_launch(tmp_path, "run")["start_weights"] == "abc"


def test_the_host_s_cpu_time_over_a_run_is_read_from_the_kernel_s_counters(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    monkeypatch.setattr(run_records, "CPU_STAT_FILE", stat)
    #                user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    launch = write_launch(tmp_path, "run", "abc", gpus=1, steps=4)
    assert launch["cpu_ticks"] == {"user": 100, "nice": 0, "system": 50, "idle": 800, "iowait": 10, "irq": 0,
                                   "softirq": 0, "steal": 40}
    (tmp_path / "run" / "logs").mkdir(parents=True)
    stat.write_text("cpu  400 20 130 1200 30 5 5 140 0 0\n")  # spent: busy 300+20+80+5+5, idle 400, iowait 20, steal 100
    add_log_readings(tmp_path, "run", launch)
    readings = read_launch(tmp_path, "run")
    assert (readings["cpu_busy_share"], readings["cpu_steal_share"]) == (round(410 / 930, 3), round(100 / 930, 3))
    stat.write_text("intr 1 2 3\n")  # not the counters' line: no shares, no failed report
    assert cpu_ticks() is None and cpu_shares(launch["cpu_ticks"], cpu_ticks()) == {
        "cpu_busy_share": None, "cpu_steal_share": None}
    assert cpu_shares(None, launch["cpu_ticks"])["cpu_steal_share"] is None  # a launch record from before the counters
    assert cpu_shares(launch["cpu_ticks"], launch["cpu_ticks"])["cpu_busy_share"] is None  # no time passed


def test_this_machine_s_cpu_counters_give_shares_between_0_and_1():
    before = cpu_ticks()
    spun_until = time.process_time() + 0.3
    while time.process_time() < spun_until:  # 0.3 s on a CPU between the readings: ~30 of its ticks busy
        pass
    shares = cpu_shares(before, cpu_ticks())
    assert 0 < shares["cpu_busy_share"] <= 1 and 0 <= shares["cpu_steal_share"] <= 1


@pytest.mark.parametrize(("starts", "expected"), [
    ({0: {"sync": "a", "async": "a"}, 1: {"sync": "b", "async": "b"}}, True),  # each seed's own model, shared
    ({0: {"sync": "a", "async": "a"}, 1: {"sync": "b", "async": "c"}}, False),  # seed 1's modes: two warm starts
    ({0: {"sync": "a", "async": None}}, None),  # a model without a digest: not known
    ({0: {"sync": None, "async": None}, 1: {"sync": "b", "async": "c"}}, False),  # one known difference is enough
    ({0: {"sync": "a"}, 1: {"async": "b"}}, None),  # no seed ran both modes: nothing compared
])
def test_the_modes_of_each_seed_are_checked_to_start_from_the_same_weights(starts, expected):
    assert modes_match(starts) is expected


def test_a_launch_record_holds_the_digest_of_the_weights_the_run_starts_from_and_its_host(tmp_path):
    launch = write_launch(tmp_path, "tts-sync-s0", "ab12", 1, 4)
    assert read_launch(tmp_path, "tts-sync-s0") == launch and launch["start_weights"] == "ab12"
    assert launch["time"] <= time.time()
    assert launch["host"]["name"] == socket.gethostname() and launch["host"]["cpus"] == os.cpu_count()
    assert launch["host"]["cpu"]  # the CPU model /proc/cpuinfo names
    boot_id = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert launch["host"]["boot_id"] == boot_id and machine_of(launch) == boot_id  # the machine, whatever its name
    assert machine_of({"host": {"name": "h1", "boot_id": None}}) == "h1"  # no boot id: the name
    assert machine_of({"time": 1.0, "gpus": 1}) is None  # a record from before hosts were kept


@pytest.mark.parametrize(("script", "gpus"), [
    ('echo "NVIDIA H100 80GB HBM3, 700.00 W, 1980 MHz"; echo "NVIDIA H100 80GB HBM3, 500.00 W, 1980 MHz"',
     ["NVIDIA H100 80GB HBM3, 700.00 W, 1980 MHz", "NVIDIA H100 80GB HBM3, 500.00 W, 1980 MHz"]),  # each GPU's line
    ('echo "NVIDIA-SMI has failed"; exit 9', []),  # a driver that does not answer: no GPU facts, no failed launch
])
def test_the_host_facts_list_each_gpu_as_nvidia_smi_reads_it(tmp_path, monkeypatch, script, gpus):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert host_facts()["gpus"] == gpus
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi at all
    assert host_facts()["gpus"] == []


@pytest.mark.parametrize(("gpus", "halves"), [([0, 1], ([0], [1])), ([4, 5, 6, 7], ([4, 5], [6, 7]))])
def test_side_by_side_gives_sync_the_first_half_of_the_gpus_and_async_the_other(gpus, halves):
    assert gpu_halves(gpus) == halves


@pytest.mark.parametrize("gpus", [[], [0], [0, 1, 2]])
def test_side_by_side_refuses_a_count_of_gpus_it_cannot_halve(gpus):
    with pytest.raises(SystemExit, match=f"sees {len(gpus)}"):
        gpu_halves(gpus)


def test_each_side_s_job_sees_only_its_gpus_and_sync_trains_on_all_of_them(tmp_path):
    args = argparse.Namespace(config="configs/gpu_longtail.yaml", overrides=["learner.lr=1e-6"], sync_ranks=0)
    sync = job_for(Mode("sync", 2), 3, args, 100, 10, tmp_path, [2, 3])
    async_ = job_for(Mode("async", 2), 3, args, 100, 10, tmp_path, [4, 5])
    assert (sync.label, async_.label) == ("tts-sync-s3", "tts-async-k2-s3")
    assert (sync.log, async_.log) == (tmp_path / "tts-sync-s3.log", tmp_path / "tts-async-k2-s3.log")
    assert (sync.env["CUDA_VISIBLE_DEVICES"], async_.env["CUDA_VISIBLE_DEVICES"]) == ("2,3", "4,5")
    assert "learner.nproc=2" in sync.command and not any("learner.nproc" in part for part in async_.command)
    assert "learner.mode=synchronous" in sync.command and "buffer.max_staleness=2" in async_.command
    assert sync.command[-2:] == ["learner.lr=1e-6", "learner.nproc=2"]  # the race's overrides reach both jobs


@pytest.mark.parametrize(("options", "message"), [
    (["--modes", "sync"], "--modes must name both, not 'sync'"),
    (["--modes", "sync,async"], "needs an even number of them, and this process sees 0"),  # this box: no GPU
])
def test_side_by_side_is_refused_before_anything_is_prepared(tmp_path, options, message):
    done = subprocess.run([sys.executable, "scripts/bench_time_to_score.py", "--side-by-side", *options, "--steps", "10",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1 and message in done.stderr
    assert not any(tmp_path.iterdir())  # no run, no record: nothing began


@pytest.mark.parametrize("last_try, then", [(False, "are tried once more after the runs"),
                                            (True, "count as skipped validations")])
def test_a_failed_evaluation_is_reported_and_the_race_goes_on_to_its_records(tmp_path, monkeypatch, capsys, last_try,
                                                                              then):
    from scripts import bench_time_to_score

    monkeypatch.setattr(bench_time_to_score, "asyncrl_command",
                        lambda *args: [sys.executable, "-c", "raise SystemExit(3)"])
    bench_time_to_score.evaluate([tmp_path], engines=4, last_try=last_try)  # no CalledProcessError: records survive
    assert f"asyncrl evaluate exited with 3 (its log above): the snapshots it left unscored {then}" in \
        capsys.readouterr().out


def test_only_a_version_whose_snapshot_is_still_there_calls_for_another_evaluation(tmp_path):
    from asyncrl.snapshots import EVALUATION_FILE, INDEX_FILE, SNAPSHOTS_DIR, snapshot_path
    from scripts.bench_time_to_score import unscored

    (tmp_path / SNAPSHOTS_DIR).mkdir()
    (tmp_path / SNAPSHOTS_DIR / INDEX_FILE).write_text("".join(
        json.dumps({"version": v, "made_at": 1.0 + v}) + "\n" for v in (0, 10, 20)))
    (tmp_path / EVALUATION_FILE).write_text(json.dumps({"version": 0}) + "\n")
    assert not unscored(tmp_path)  # 10 and 20 unscored, their files gone with another host: nothing to start for
    snapshot_path(tmp_path, 20).write_bytes(b"weights")
    assert unscored(tmp_path)


def test_a_run_s_records_are_archived_before_its_scoring_begins(tmp_path, monkeypatch):
    """A host's time may end while a run is scored (minutes at ~600 M parameters): its pace must come back anyway."""
    import tarfile

    from scripts import bench_time_to_score

    archive = tmp_path / "records.tar.gz"

    def run_job(mode, seed, *rest):
        run_dir = tmp_path / "runs" / mode.run_name(seed)
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps(step(1, 120.0, 15.0, 3.0, 100.0)) + "\n")

    archived_when_scored = []

    def evaluate(run_dirs, engines, last_try=False):
        with tarfile.open(archive) as records:
            archived_when_scored.append(sorted(records.getnames()))

    monkeypatch.setattr(bench_time_to_score, "run_job", run_job)
    monkeypatch.setattr(bench_time_to_score, "evaluate", evaluate)
    monkeypatch.setattr(bench_time_to_score, "report", lambda *args: None)
    monkeypatch.setattr(sys, "argv", ["bench_time_to_score.py", "--modes", "async", "--skip-prepare", "--steps", "10",
                                      "--archive", str(archive), "--out-dir", str(tmp_path / "runs")])
    bench_time_to_score.main()
    name = Mode("async", 2).run_name(0)
    assert archived_when_scored[0] == [f"{name}/metrics.jsonl"]


@pytest.mark.parametrize("compiles_learner", [False, True])
def test_the_preparation_loads_the_learner_once_only_where_it_compiles(monkeypatch, compiles_learner):
    from scripts import bench_time_to_score

    commands = []
    monkeypatch.setattr(bench_time_to_score.subprocess, "run", lambda command, **_: commands.append(command))
    args = parse_args(["--config", "configs/gpu_longtail.yaml", "learner.compile=true", "--steps", "10"])
    bench_time_to_score.prepare(args, compiles_learner)
    scripts = [pathlib.Path(command[1]).name if command[1].endswith(".py") else command[3] for command in commands]
    assert scripts == ["data", "init-model", "engine_ceiling.py"] + ["learner_warm_up.py"] * compiles_learner
    assert commands[-1][-1] == "learner.compile=true"  # every step of it on the race's overrides
