"""scripts/gpu_bench.sh's sweep stage: every rate's run on the host's first GPU at once, each held to its part of the
card (the card's memory over the rates, less 2 GiB) with a fixed KV cache, the caller's options before the
overrides; the race's shapes (RACE_SHAPE) in the sweep and race stages; and the race_session stage's three calls.
nvidia-smi and Python are stood in for: nvidia-smi prints a card's total memory in MiB, and the stand-in Python
records how it was called (each argument quoted: an empty one too)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
H200_MIB, H100_MIB = 143771, 81559  # nvidia-smi's memory.total of the device's cards


def stage_sweep(tmp_path: Path, card_mib: int, **env: str) -> list[str]:
    """The sweep stage's lr_sweep.py command line, with CUDA_VISIBLE_DEVICES first."""
    return stage_command(tmp_path, "sweep", "scripts/lr_sweep.py", card_mib, **env)


def stage_command(tmp_path: Path, stage: str, script: str, card_mib: int, **env: str) -> list[str]:
    """The `stage`'s command line of `script`, with CUDA_VISIBLE_DEVICES first."""
    return stage_commands(tmp_path, stage, script, card_mib, **env)[0]


def stage_commands(tmp_path: Path, stage: str, script: str, card_mib: int, failing: str = "", failing_status: int = 3,
                   **env: str) -> list[list[str]]:
    """Every command line of `script` the `stage` ran, in order, each with CUDA_VISIBLE_DEVICES first; the stand-in
    Python exits with `failing_status` from a call whose arguments hold `failing` (where given); gpu_bench.sh's console
    goes to tmp_path/console."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(parents=True)
    (bin_dir / "nvidia-smi").write_text(f"#!/usr/bin/env bash\necho {card_mib}\n")
    fail = f'[[ "$*" == *"{failing}"* ]] && exit {failing_status}\n' if failing else ""
    (bin_dir / "python").write_text(f'#!/usr/bin/env bash\necho "$CUDA_VISIBLE_DEVICES $(printf "%q " "$@")" >> {calls}\n'
                                    f'{fail}cat > /dev/null\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), stage], capture_output=True, text=True,
                          timeout=60, env=os.environ | env | {"PATH": f"{bin_dir}:{os.environ['PATH']}",
                                                              "PYTHON": str(bin_dir / "python"),
                                                              "OUT": str(tmp_path / "out")})
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "console").write_text(done.stdout)  # gpu_bench.sh's own lines: each stage's exit status
    return [shlex.split(line) for line in calls.read_text().splitlines() if script in line]


def test_three_rates_share_an_h200_each_in_its_part_with_the_caller_s_options_first(tmp_path):
    command = stage_sweep(tmp_path, H200_MIB, SWEEP_ARGS="--steps 30 --val-every 5 model.tiny.num_layers=24")
    assert command[0] == "0"  # the host's first GPU
    assert command[command.index("--lrs") + 1] == "1e-6,2.5e-6,5e-6"
    tail = command[command.index("--out-dir") + 2:]
    assert tail[:5] == ["--steps", "30", "--val-every", "5", "model.tiny.num_layers=24"]
    assert "run.gpu_memory_gib=44" in tail  # 140 GiB / 3 = 46, less 2
    assert "rollout.engine.kv_cache_memory_gib=8" in tail


@pytest.mark.parametrize(("rates", "part"), [("2e-6,5e-6", 37), ("5e-6", 77)])  # 79 GiB / 2 = 39, less 2; 79 - 2
def test_the_part_follows_the_card_and_the_number_of_rates(tmp_path, rates, part):
    command = stage_sweep(tmp_path, H100_MIB, SWEEP_LRS=rates, SWEEP_KV_GIB="4",
                          SWEEP_ARGS="--steps 20 --val-every 5")
    assert command[command.index("--lrs") + 1] == rates
    assert f"run.gpu_memory_gib={part}" in command and "rollout.engine.kv_cache_memory_gib=4" in command


def test_the_600m_shape_adds_its_overrides_after_the_sweep_s_arguments_and_before_the_race_s(tmp_path):
    command = stage_sweep(tmp_path, H200_MIB, RACE_SHAPE="600m", SWEEP_ARGS="--steps 30 --val-every 5 learner.lr=1e-6")
    tail = command[command.index("--out-dir") + 2:]
    assert tail[:5] == ["--steps", "30", "--val-every", "5", "learner.lr=1e-6"]
    assert {"model.tiny.hidden_size=1536", "model.tiny.num_layers=24", "buffer.batch_groups=64",
            "model.path=.cache/models/gpu_longtail_600m", "model.warm_start.eval_samples=0"} <= set(tail[5:])
    preset = stage_sweep(tmp_path / "preset", H200_MIB, SWEEP_ARGS="--steps 30 --val-every 5")
    assert not any(argument.startswith("model.") for argument in preset)  # the preset's own shape
    race = stage_command(tmp_path / "race", "race", "scripts/bench_time_to_score.py", H200_MIB, RACE_SHAPE="600m",
                         RACE_MODES="sync", RACE_ARGS="--seeds 1 learner.lr=1e-6 --restore a.tar.gz")
    # the race's own arguments last: a --restore among them must not take the shape's overrides for its files
    assert race[-5:] == ["--seeds", "1", "learner.lr=1e-6", "--restore", "a.tar.gz"]
    assert "buffer.batch_groups=64" in race[race.index("--out-dir"):-5]


def test_an_unknown_shape_is_refused_by_name(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), "race"], capture_output=True, text=True,
                          timeout=60, env=os.environ | {"RACE_SHAPE": "7b", "OUT": str(tmp_path / "out"),
                                                        "PYTHON": "false"})
    assert "RACE_SHAPE=7b: not a shape of the race" in done.stdout + done.stderr
    assert "=== race exit 1" in done.stdout


CALLER_ARGS = ["--seeds", "1", "--max-staleness", "3", "--restore", "a.tar.gz"]  # a race session's RACE_ARGS


def race_session(tmp_path: Path, failing: str = "", failing_status: int = 3,
                 **env: str) -> list[tuple[str, list[str]]]:
    """The race_session stage's bench_time_to_score.py calls: each one's --modes and its arguments from --archive on."""
    calls = stage_commands(tmp_path, "race_session", "scripts/bench_time_to_score.py", H100_MIB, failing,
                           failing_status, RACE_SHAPE="600m", RACE_ARGS=shlex.join(CALLER_ARGS), **env)
    return [(call[call.index("--modes") + 1], call[call.index("--archive"):]) for call in calls]


def test_a_race_session_runs_both_modes_unscored_then_scores_both_then_measures_the_ceiling(tmp_path):
    (runs, runs_args), (scoring, scoring_args), (ceiling, ceiling_args) = race_session(tmp_path)
    assert (runs, scoring, ceiling) == ("sync,async", "", "ceiling")  # the scores first: the snapshots die with the host
    # the session's options just before the caller's, whose --restore ends every call; the warm start made once
    assert runs_args[-7:] == ["--no-evaluate", *CALLER_ARGS] and "--skip-prepare" not in runs_args
    assert "--deadline" not in runs_args  # no RACE_DEADLINE: the race runs to its end
    assert ceiling_args[-10:] == ["--skip-prepare", "--no-evaluate", "--ceiling-seconds", "30", *CALLER_ARGS]
    assert scoring_args[-7:] == ["--skip-prepare", *CALLER_ARGS] and "--no-evaluate" not in scoring_args
    assert all("buffer.batch_groups=64" in args for args in (runs_args, ceiling_args, scoring_args))


def test_a_race_session_without_the_ceiling_only_runs_and_scores(tmp_path):
    assert [modes for modes, _ in race_session(tmp_path, RACE_CEILING_S="0")] == ["sync,async", ""]


def test_a_failed_run_skips_the_ceiling_and_still_scores_what_ran(tmp_path):
    assert [modes for modes, _ in race_session(tmp_path, failing="sync,async")] == ["sync,async", ""]
    assert "=== race_session exit 3 " in (tmp_path / "console").read_text()  # the failed run's status, once scored


def test_a_race_past_its_deadline_ran_a_pace_so_nothing_is_scored_and_the_ceiling_follows(tmp_path):
    calls = race_session(tmp_path, failing="--deadline", failing_status=75, RACE_DEADLINE="1765100000")
    (runs, runs_args), (ceiling, _) = calls  # no scoring call between them: the pace is not scored
    assert (runs, ceiling) == ("sync,async", "ceiling")
    # the 600m shape's fastest sync step on record: a race out of reach even at that pace runs its pace at once
    assert runs_args[-11:] == ["--no-evaluate", "--deadline", "1765100000", "--fastest-step-s", "5.25", *CALLER_ARGS]
    assert "=== race_session exit 75 " in (tmp_path / "console").read_text()


def test_the_warm_stage_makes_the_race_s_data_and_model_with_the_shape_s_overrides(tmp_path):
    calls = stage_commands(tmp_path, "warm", "-m launch", H100_MIB, RACE_SHAPE="600m")
    assert [call[call.index("launch") + 1] for call in calls] == ["data", "init-model"]  # no engine: no vLLM
    for call in calls:  # the race's preparation gives the same: init-model's cache then holds its model
        assert {"--config", "configs/gpu_longtail.yaml", "model.path=.cache/models/gpu_longtail_600m",
                "learner.compile=true", "metrics.wandb_mode=disabled"} <= set(call)


def test_the_servers_stage_measures_the_engines_then_paces_sync_against_async_of_that_many_servers(tmp_path):
    engines = stage_commands(tmp_path / "engines", "servers", "scripts/bench_engines.py", H100_MIB, RACE_SHAPE="600m",
                             SERVERS="3")
    assert len(engines) == 1 and engines[0][engines[0].index("--engines") + 1] == "1,3"
    assert "rollout.max_inflight=1536" in engines[0]  # the race's shape: each count splits its samples in flight
    calls = stage_commands(tmp_path / "race", "servers", "scripts/bench_time_to_score.py", H100_MIB, RACE_SHAPE="600m",
                           SERVERS="3")
    assert [call[call.index("--modes") + 1] for call in calls] == ["sync", "async", ""]  # then both reported
    pace = ["--val-every", "20", "--seeds", "0", "--max-staleness", "4", "--async-servers", "3", "--no-evaluate"]
    assert calls[0][-11:] == [*pace, "--steps", "20"]  # its preparation fills vLLM's cache for both modes' engines
    assert calls[1][-12:] == ["--skip-prepare", *pace, "--steps", "40"] and calls[2][-12:] == calls[1][-12:]
    assert all(call[call.index("--out-dir") + 1] == "/tmp/asyncrl-servers" for call in calls)


def test_the_servers_stage_without_engine_counts_runs_the_pace_alone(tmp_path):
    assert stage_commands(tmp_path / "engines", "servers", "scripts/bench_engines.py", H100_MIB, RACE_SHAPE="600m",
                          ENGINES_COUNTS="") == []
    calls = stage_commands(tmp_path / "race", "servers", "scripts/bench_time_to_score.py", H100_MIB, RACE_SHAPE="600m",
                           ENGINES_COUNTS="")
    assert [call[call.index("--modes") + 1] for call in calls] == ["sync", "async", ""]
