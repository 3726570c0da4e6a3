"""The race to a held-out score at CPU size (scripts/bench_time_to_score.py, the benchmark itself): the synchronous
run and the async job from one warm start, each keeping the weights of every due version (validation.after_run),
each scored by `asyncrl evaluate --drop-scored` as soon as it ends. Every due version is scored and its weights
deleted, both modes learn, and the evaluator scores the shared starting model the same in both. The engine's ceiling is tested on its own
(test_engine_ceiling.py), and how `--engines N` hands snapshots out in tests/unit/launch/test_evaluate.py: each would
start one more engine here, in the suite's longest job.

The reward is the response's length (tests/fixtures/length_reward.py): a barely trained model learns it in a few
steps, so "learns" is a held-out rise that a handful of steps can show."""

import json
from pathlib import Path

import pytest

from asyncrl.snapshots import made_times, read_evaluation
from run_helpers import RUN_TIMEOUT_S, learning_script_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS, VAL_EVERY = 6, 3
DUE = [0, 3, 6]
BENCH = Path(__file__).parents[2] / "scripts" / "bench_time_to_score.py"
RUNS = ("tts-sync-s0", "tts-async-k2-s0")


def race_job(inputs: Path, own_dir: Path) -> tuple[Path, dict]:
    """The benchmark over the shared tiny model (its files made already), in `own_dir`; its RESULT."""
    import subprocess
    import sys

    overrides = learning_script_job(inputs, STEPS)
    done = subprocess.run([sys.executable, str(BENCH), "--config", "configs/quickstart.yaml", "--steps", str(STEPS),
                           "--val-every", str(VAL_EVERY), "--warmup-steps", "1", "--skip-prepare",
                           "--archive", str(own_dir / "records.tar.gz"), "--out-dir", str(own_dir), *overrides],
                          capture_output=True, text=True,
                          timeout=3 * RUN_TIMEOUT_S, cwd=BENCH.parents[1])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return own_dir, json.loads(result[len("RESULT "):])


REAL_JOBS = [race_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def race(real_jobs) -> tuple[Path, dict]:
    return real_jobs[race_job].result()


def test_every_due_version_of_both_modes_is_kept_and_scored_in_the_order_it_was_made(race):
    root, result = race
    assert result["validations_skipped"] == 0 and result["validations_unscored"] == 0
    for name in RUNS:
        made, scored = made_times(root / name), read_evaluation(root / name)
        assert sorted(made) == DUE and sorted(scored) == DUE
        assert [made[v] for v in DUE] == sorted(made[v] for v in DUE)  # each version after the one before
        assert all(scored[v]["made_at"] == made[v] for v in DUE)
        assert not list((root / name / "snapshots").glob("*.pt"))  # each dropped once scored


def test_one_evaluator_scores_the_shared_start_the_same_in_both_modes_and_both_learn(race):
    _, result = race
    sync, async_ = result["sync"]["curves"][0], result["async"]["curves"][0]
    assert [v for v, _, _ in sync] == DUE and [v for v, _, _ in async_] == DUE
    assert sync[0][2] == async_[0][2]  # version 0: the same model, prompts and seeds
    assert result["start_models_match"] is True  # both launch records hold the digest of that one warm start
    assert result["same_host"] is True  # and this machine as the host of both
    for curve in (sync, async_):
        assert curve[-1][2] > curve[0][2]  # the held-out score rose
    assert result["target"] is not None and result["sync_baseline"] == "cpu" and result["seeds"] == [0]
    assert result["sync"]["version_at_target"] in DUE and result["async"]["version_at_target"] in DUE
    assert 0 < result["learner_share_of_sync_step"] < 1
    for mode, curve in (("sync", sync), ("async", async_)):  # each mode's pace over its scored span, no MPS on a CPU
        pace = (curve[-1][1] - curve[0][1]) / (curve[-1][0] - curve[0][0])
        assert result[mode]["time_per_version_s"] == pytest.approx(pace, abs=0.06)  # the curve's times: to 0.1 s
        assert result[mode]["runs_under_mps"] == 0
        assert 0 < result[mode]["cpu_busy_share"] <= 1 and 0 <= result[mode]["cpu_steal_share"] < 1  # the host's
    assert result["version_pace_speedup"] == pytest.approx(
        result["sync"]["time_per_version_s"] / result["async"]["time_per_version_s"], abs=2e-3)
    assert result["step_pace_speedup"] == pytest.approx(
        result["sync"]["time_per_step_s"] / result["async"]["time_per_step_s"], abs=2e-3)


def test_the_archive_holds_every_run_s_records_and_no_weights(race):
    import tarfile

    root, _ = race
    with tarfile.open(root / "records.tar.gz") as archive:
        names = set(archive.getnames())
    for run in RUNS:
        assert {f"{run}/config.yaml", f"{run}/metrics.jsonl", f"{run}/evaluation.jsonl",
                f"{run}/snapshots/made.jsonl", f"{run}.launch.json"} <= names
    assert not any(name.endswith(".pt") for name in names)
