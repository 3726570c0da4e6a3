"""`buffer.max_staleness=auto` in a real job (`asyncrl run`: buffer, learner, one vLLM server on the CPU).

One short run is set up to exercise both directions of the controller: at K = 0 the learner must wait for
every batch (the server holds one group at a time, and on-policy it can only start the next batch's groups
after the weights reach it), so K rises; at K >= 1 a high learning rate with a reward that differs inside
every group moves the policy a lot per version, so the stale samples' drift (rollout_corr/mismatch_kl)
exceeds its bound and K falls again. The test replays the real controller on the signals the run logged and
checks that the run took exactly those decisions, that the buffer and the samples' starts followed the
changing K, and that the checkpoint holds the last one.
"""

import json
import re
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.metrics import read_metrics
from learner.services.pacing import Pacer
from run_helpers import LENGTH_REWARD, asyncrl, tiny_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 12
K_MIN, K_MAX = 0, 2
SAMPLES_PER_GROUP = 4
CHANGE_LINE = re.compile(r"pacing: max_staleness (\d+) -> (\d+) after step (\d+): (.*)")


def paced_job(inputs: Path, tmp: Path) -> tuple[Path, list[dict]]:
    overrides = tiny_job(
        inputs, STEPS, f"run.root_dir={tmp / 'runs'}", "run.name=paced", "validation.every=0",
        "buffer.max_staleness=auto", f"buffer.pacing.k_min={K_MIN}", f"buffer.pacing.k_max={K_MAX}",
        f"buffer.pacing.k_start={K_MIN}", "buffer.pacing.window=2", "buffer.batch_groups=4",
        f"rollout.sampling.n={SAMPLES_PER_GROUP}", f"rollout.max_inflight={SAMPLES_PER_GROUP}",  # one group at a time
        "learner.lr=0.05", f"learner.checkpoint_every={STEPS}",
        *LENGTH_REWARD,
    )
    done = asyncrl("run", *overrides)
    run_dir = tmp / "runs" / "paced"
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, read_metrics(run_dir)


REAL_JOBS = [paced_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def paced_run(real_jobs):
    return real_jobs[paced_job].result()


def bounds(records) -> list[int]:
    return [record["staleness/max_staleness"] for record in records]


def test_k_rises_while_the_learner_waits_and_falls_when_drift_grows_within_its_bounds(paced_run):
    run_dir, records = paced_run
    ks = bounds(records)
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    assert ks[0] == K_MIN and all(K_MIN <= k <= K_MAX for k in ks)
    changes = [(before, after) for before, after in zip(ks, ks[1:]) if after != before]
    assert all(abs(after - before) == 1 for before, after in changes)
    assert any(after > before for before, after in changes) and any(after < before for before, after in changes)
    logged = [(int(before), int(after), int(step), reason)  # one log line per change, with its reason
              for before, after, step, reason in CHANGE_LINE.findall((run_dir / "logs" / "learner0.log").read_text())
              if int(step) < STEPS]  # a change after the last step has no record to show it
    assert [(before, after) for before, after, _, _ in logged] == changes
    assert [step for _, _, step, _ in logged] == [step for step in range(1, STEPS) if ks[step] != ks[step - 1]]
    assert all(reason.startswith("the learner waits for batches") for before, after, _, reason in logged if after > before)
    falls = [reason for before, after, _, reason in logged if after < before]
    assert all(reason.startswith("drift above its bound") for reason in falls) and falls


def test_the_run_took_the_controllers_decisions_on_its_logged_signals(paced_run):
    run_dir, records = paced_run
    settings = load_config(run_dir / "config.yaml").buffer.pacing
    pacer = Pacer(settings, K_MIN)
    replayed = [pacer.k] + [pacer.observe(record["step"], record).k for record in records]
    assert bounds(records) == replayed[:-1]
    meta = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())
    assert meta["max_staleness"] == replayed[-1]  # a resumed run continues with the K decided last


def test_the_buffer_and_the_trained_samples_follow_the_changing_k(paced_run):
    _, records = paced_run
    for record in records:
        assert record["buffer/max_staleness"] == record["staleness/max_staleness"]  # named in the step's batch request
        assert record["staleness/start_lag_max"] <= record["staleness/max_staleness"]  # the rule, judged at the start
        assert record["buffer/dropped_stale"] == 0
