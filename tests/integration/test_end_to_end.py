"""The whole loop with real parts: buffer process, learner with two gloo ranks, two vLLM rollout servers.

Checks the contracts that only the assembled system can show: versions advance, every trained group started
from weights within K of the learner and none was dropped, weights reach the servers every step, checkpoints commit buffer offsets, and a resumed
run continues the step counter and the buffer position without training on any record twice.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.learner_plan import read_plan
from asyncrl.metrics import read_metrics, step_records
from run_helpers import RUN_TIMEOUT_S, asyncrl, tiny_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_STALENESS = 1
SAMPLES_PER_GROUP = 4
VALIDATE_EVERY = 3  # server 0 validates versions 0, 3, 6 and each run's final version (4 in the first)


def overrides(tmp: Path, total_steps: int) -> list[str]:
    return tiny_job(
        tmp, total_steps, "run.name=e2e", "learner.nproc=2", "learner.checkpoint_every=2", "buffer.batch_groups=4",
        f"buffer.max_staleness={MAX_STALENESS}", "rollout.num_servers=2", "rollout.max_inflight=8",
        f"rollout.sampling.n={SAMPLES_PER_GROUP}", f"validation.every={VALIDATE_EVERY}", "validation.n=2", "validation.k=2",
        "validation.max_prompts=4",
    )


def resumed_job(inputs: Path, _: Path):
    """A run of 4 steps on the shared task files and model, then the same run resumed to step 6."""
    first = asyncrl("run", *overrides(inputs, 4))
    run_dir = inputs / "runs" / "e2e"
    first_records = step_records(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else []
    second = asyncrl("run", *overrides(inputs, 6))  # resume=auto: continue to step 6
    return first, second, first_records, run_dir


REAL_JOBS = [resumed_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def finished_runs(real_jobs):
    return real_jobs[resumed_job].result()


def test_run_completes_and_prints_run_dir(finished_runs):
    first, second, _, run_dir = finished_runs
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    assert first.stdout.strip().splitlines()[-1] == f"RUN_DIR {run_dir}"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "logs" / "rollout0.log").is_file()
    # the learner's passes as it ran them, for `asyncrl tune`: on the CPU no checkpointing, whatever is configured
    assert read_plan(run_dir).activation_checkpointing == "none"


def test_versions_advance_and_every_group_starts_within_k(finished_runs):
    _, _, first_records, run_dir = finished_runs
    assert [r["step"] for r in first_records] == [1, 2, 3, 4]
    for record in step_records(read_metrics(run_dir)):
        assert record["staleness/start_lag_max"] <= MAX_STALENESS and record["buffer/dropped_stale_in_batch"] == 0
        assert record["batch/samples"] == 4 * SAMPLES_PER_GROUP
    later = [r for r in first_records if r["step"] >= 2]
    assert all(r["weight_sync/servers_ok"] == 2 for r in later), [r["weight_sync/servers_ok"] for r in later]


def test_resume_continues_steps_and_never_reuses_a_buffer_record(finished_runs):
    _, _, _, run_dir = finished_runs
    records = step_records(read_metrics(run_dir))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000004", "step_00000006"]  # learner.keep_checkpoints=2
    meta = json.loads((run_dir / "checkpoints" / "step_00000006" / "meta.json").read_text())
    # The final position counts each record consumed once; a record handed out twice (e.g. again after the
    # resume) would make the batches' groups and drops add up to more.
    consumed = meta["buffer_offset"] + len(meta["buffer_ahead"])
    handed_out = sum(r["batch/samples"] / SAMPLES_PER_GROUP + r["buffer/dropped_stale_in_batch"] for r in records)
    assert meta["step"] == 6 and consumed == handed_out


def test_validation_is_logged_once_per_pass_and_the_run_plots(finished_runs):
    _, _, _, run_dir = finished_runs
    passes = [r for r in read_metrics(run_dir) if r.get("val/score/mean") is not None]
    versions = [r["val/version"] for r in passes]
    assert {0.0, 4.0, 6.0} <= set(versions)  # the learner waits for each run's final version
    assert len(versions) == len(set(versions)), versions  # each pass logged once
    # the resumed run's servers start on the model's first weights: they catch up before validating, not score 0 again
    assert [r["val/version"] for r in passes if r["step"] > 4] == [6.0]
    assert all(v % VALIDATE_EVERY == 0 or v in (4.0, 6.0) for v in versions)
    assert all(r["val/prompts"] == 4 and 0.0 <= r["val/pass@2"] <= 1.0 for r in passes)
    assert all(r["val/arithmetic/score/mean"] == r["val/score/mean"] for r in passes)  # one data source
    plotted = subprocess.run([sys.executable, "-m", "launch.cli", "plot", str(run_dir)], capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    assert plotted.returncode == 0, plotted.stderr
    assert {"reward.png", "staleness.png", "weight_sync.png"} <= {p.name for p in (run_dir / "plots").iterdir()}
