"""A multi-task run that steers itself, as a real job (`asyncrl run`: buffer, learner, one vLLM rollout
server), one run for every assertion: a task that saturates gives its share of the prompts to one still
improving and the server draws with the learner's weights; every reward entry is logged per task (train and
validation); a reward that turns adversarial for a few samples collapses the watched metric, and the safety
guard rolls the learner back, discards what was trained since, and the run recovers and finishes."""

import json
from pathlib import Path

import pytest

from asyncrl.data import write_rows
from asyncrl.metrics import read_metrics, step_records
from run_helpers import asyncrl, tiny_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REWARD_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "task_mix_reward.py"
STEPS = 20
GROUPS = 8  # per batch
SAMPLES_PER_GROUP = 2
MAX_STALENESS = 1
PATIENCE = 2
MIN_WEIGHT = 0.1
LR = 0.001
LR_SCALE = 0.5
CHECKPOINT_EVERY = 2
ROLLBACK_STEPS = 2
MAX_ROLLBACKS = 3
LATE_FROM = 8  # records from here on were drawn at a share of 0.125 or less (cuts at about 3, 5, 7), 0.25 for a few steps
# after a rollback to an early checkpoint


def task_file(path: Path, data_source: str, count: int) -> str:
    rows = [{"prompt": [{"role": "user", "content": f"{i % 10}+{i // 10 % 10}="}], "data_source": data_source,
             "reward_model": {"style": "rule", "ground_truth": str(i % 10 + i // 10 % 10)}} for i in range(count)]
    return str(write_rows(rows, path))


def task_mix_job(_: Path, tmp: Path) -> tuple[list[dict], Path]:
    """Its own task files and model (not the shared tiny job's)."""
    solved, rising = task_file(tmp / "solved.jsonl", "solved", 100), task_file(tmp / "rising.jsonl", "rising", 100)
    overrides = tiny_job(
        tmp, STEPS, "run.name=tasks", "model.warm_start.steps=0", "model.warm_start.eval_samples=1", f"learner.lr={LR}",
        f"data.train_files=[{solved},{rising}]", f"data.val_files=[{task_file(tmp / 'val.jsonl', 'rising', 4)}]",
        f"reward.custom_fn.path={REWARD_FILE}", "reward.num_workers=1", "data.task_weights.enabled=true", f"data.task_weights.patience={PATIENCE}",
        "data.task_weights.min_delta=0.0", "data.task_weights.factor=0.5", f"data.task_weights.min_weight={MIN_WEIGHT}",
        "guard.enabled=true", "guard.watch=[{name: critic/rising/score/mean, max_drop: 0.1}]", "guard.window=5",
        f"guard.rollback_steps={ROLLBACK_STEPS}", f"guard.lr_scale={LR_SCALE}", f"guard.max_rollbacks={MAX_ROLLBACKS}",
        f"buffer.batch_groups={GROUPS}", f"rollout.sampling.n={SAMPLES_PER_GROUP}", f"buffer.max_staleness={MAX_STALENESS}",
        "rollout.max_inflight=16", f"learner.checkpoint_every={CHECKPOINT_EVERY}", "learner.keep_checkpoints=3",
        "validation.every=100", "validation.n=2", "validation.k=2",
    )
    built = asyncrl("init-model", *overrides)
    assert built.returncode == 0, built.stderr[-3000:]
    done = asyncrl("run", *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp / "runs" / "tasks"
    return step_records(read_metrics(run_dir)), run_dir


REAL_JOBS = [task_mix_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def finished_run(real_jobs):
    return real_jobs[task_mix_job].result()


def collapses(records):
    return [r for r in records if r["guard/collapse"] == 1.0]


def test_the_saturated_tasks_weight_falls_to_the_floor_and_the_improving_one_takes_it(finished_run):
    records, _ = finished_run
    solved = [r["tasks/solved/weight"] for r in records]
    assert all(r["tasks/solved/weight"] + r["tasks/rising/weight"] == pytest.approx(1.0) for r in records)
    assert solved[0] == 0.5 and solved[-1] == pytest.approx(MIN_WEIGHT)
    assert records[-1]["tasks/rising/weight"] == pytest.approx(1 - MIN_WEIGHT)
    # each cut halves the share, once per patience: 0.5 → 0.25 → 0.125 → 0.1 (the floor); it rises only when a
    # rollback restores the weights of an earlier checkpoint
    assert {round(w, 6) for w in solved} == {0.5, 0.25, 0.125, 0.1}
    for earlier, later in zip(records, records[1:]):
        assert later["tasks/solved/weight"] <= earlier["tasks/solved/weight"] or earlier["guard/collapse"] == 1.0


def test_the_server_draws_with_the_learners_weights(finished_run):
    records, _ = finished_run
    late = [r for r in records if r["step"] >= LATE_FROM]
    solved_samples = sum(r.get("batch/solved/samples", 0.0) for r in late)
    total = sum(r["batch/samples"] for r in late)
    # drawn at a share of 0.125 or less, 0.25 at times (0.5 with the configured weights): ≥ 80 groups, far below 0.3
    assert solved_samples / total < 0.3, (solved_samples, total)


def test_reward_entries_are_logged_per_task_in_training_and_validation(finished_run):
    records, _ = finished_run
    solved = [r for r in records if "critic/solved/score/mean" in r]
    assert solved and all(r["critic/solved/score/mean"] == 1.0 and r["critic/solved/acc/mean"] == 1.0 for r in solved)
    assert all(0.0 <= r["critic/rising/acc/mean"] <= 1.0 for r in records if "critic/rising/acc/mean" in r)
    validated = [r for r in records if "val/rising/acc/mean" in r]
    assert validated and validated[-1]["val/version"] == STEPS and 0.0 <= validated[-1]["val/rising/acc/mean"] <= 1.0


def test_the_guard_rolls_back_each_collapse_and_the_run_recovers(finished_run):
    records, run_dir = finished_run
    found = collapses(records)
    assert 1 <= len(found) <= MAX_ROLLBACKS, [r["step"] for r in found]
    first = found[0]
    # the newest checkpoint at least ROLLBACK_STEPS before the collapse (every CHECKPOINT_EVERY steps until then)
    assert first["guard/rollback_to"] == (first["step"] - ROLLBACK_STEPS) // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    steps = [r["step"] for r in records]
    for collapse in found:
        after = records[steps.index(collapse["step"]) + 1]
        # the version moves past the staleness bound (K + 1), then trains on: no sample of the collapsed policy is trained
        assert after["step"] == collapse["step"] + MAX_STALENESS + 2
        assert after["guard/rollbacks"] == collapse["guard/rollbacks"] + 1
        # discarded, counted in guard/discarded_samples: the samples trained since the checkpoint, and the K + 1
        # batches the collapsed policy had been admitted to sample (drained, never trained)
        rolled_back = [r for r in records if collapse["guard/rollback_to"] < r["step"] <= collapse["step"]]
        drained = (MAX_STALENESS + 1) * GROUPS * SAMPLES_PER_GROUP
        assert after["guard/discarded_samples"] == collapse["guard/discarded_samples"] + sum(
            r["batch/samples"] for r in rolled_back) + drained
        assert after["actor/lr"] == pytest.approx(LR * LR_SCALE ** after["guard/rollbacks"])
    recovered = records[steps.index(found[-1]["step"]) + 1:]
    assert len(recovered) >= 3 and all(r["critic/rising/score/mean"] >= 1.0 for r in recovered)
    # the version counts the batches consumed, so admission's bound holds after the rollback: nothing goes stale
    assert all(r["buffer/dropped_stale_in_batch"] == 0 for r in recovered)
    assert steps[-1] == STEPS
    assert "GUARD ALERT: critic/rising/score/mean" in (run_dir / "logs" / "learner0.log").read_text()


def test_no_sample_is_trained_twice_and_the_checkpoint_holds_weights_and_guard(finished_run):
    records, run_dir = finished_run
    meta = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())
    saved = {task["name"]: task["share"] for task in meta["task_weights"]["tasks"]}
    assert saved == pytest.approx({"solved": records[-1]["tasks/solved/weight"], "rising": records[-1]["tasks/rising/weight"]})
    rollbacks = len(collapses(records))
    assert meta["guard"]["rollbacks"] == rollbacks and meta["lr_scale"] == pytest.approx(LR_SCALE ** rollbacks)
    # the buffer position never moved back: every record consumed (trained, drained by a rollback, or dropped as
    # stale) was handed out once
    consumed = meta["buffer_offset"] + len(meta["buffer_ahead"])
    trained = sum(r["batch/samples"] / SAMPLES_PER_GROUP + r["buffer/dropped_stale_in_batch"] for r in records)
    assert consumed == trained + records[-1]["guard/drained_groups"]
