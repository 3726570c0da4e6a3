"""The async job with max_staleness=0 reproduces the synchronous reference (`learner.mode=synchronous`,
launch/reference_loop.py: one process, its own engine, no buffer) step by step: the same samples (prompt,
completion, behaviour log-probs, token versions, reward), the same losses and gradient norms, and every trained
token sampled by the policy version it is trained at (staleness 0). With max_staleness=1 the same comparison
fails. The tolerance is zero: every compared value is equal to the last bit. The same holds with the policy trained
and served as a LoRA adapter (`model.lora`).

What makes it exact: both draw server 0's prompt stream with run.seed and seed each group from its place in it
(rollout.seeded_sampling); both give the engine the batch's requests together, with the same weights; both
train the rows in content order (learner/policy/policy_trainer.py `canonical_order`) with the learner's model and loss.
Validation is off: its requests would share the engine's batches with the rollouts, a case not compared.

Both runs train with the same learner code (advantages, losses, optimizer step) and sample with the same engine
code, so this shows that the async plumbing (buffer, admission, weight sync, versions) changes nothing at K = 0;
a mistake in the shared maths would show in both alike. tests/unit/learner/test_independent_grpo.py checks that
maths against a step written apart from the learner.
"""

import math
from pathlib import Path

import pytest

from asyncrl.config.buffer import BufferConfig
from asyncrl.messages import TrajectoryGroup, decode
from asyncrl.metrics import read_metrics
from launch.reference_loop import trained_groups
from buffer.log import SegmentLog
from run_helpers import LENGTH_REWARD, asyncrl, tiny_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 3
BATCH_GROUPS = 4
SAMPLES_PER_GROUP = 4
COMPARED_METRICS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean", "response_length/mean")


def job(tmp: Path, name: str, *mode: str) -> list[str]:
    return tiny_job(
        tmp, STEPS, f"run.name={name}", "run.seed=7", f"buffer.batch_groups={BATCH_GROUPS}",
        f"rollout.sampling.n={SAMPLES_PER_GROUP}", "validation.every=0", "learner.lr=0.01", "learner.sync_every=1",
        # Room for two batches in flight: with K=1 the server samples the second batch under version 0 at once.
        f"rollout.max_inflight={2 * BATCH_GROUPS * SAMPLES_PER_GROUP}",
        # Rewards that differ inside every group: each step has a loss and an update to compare.
        *LENGTH_REWARD, *mode,
    )


Sample = tuple  # (prompt ids, completion ids, behaviour log-probs, token versions, reward)


def samples(groups: list[TrajectoryGroup]) -> list[Sample]:
    return sorted((tuple(t.prompt_ids), tuple(t.completion_ids), tuple(t.behaviour_logprobs), tuple(t.token_versions),
                   t.reward) for g in groups for t in g.trajectories)


def consumed_groups(run_dir: Path, record: dict) -> list[TrajectoryGroup]:
    """The groups an async step trained on, read back from the buffer log (its offsets span exactly them at K=0)."""
    log = SegmentLog(run_dir / "buffer", BufferConfig().segment_bytes, "none")
    try:
        first, last = int(record["batch/offset_min"]), int(record["batch/offset_max"])
        return [decode(payload, expect=TrajectoryGroup) for _, payload in log.read_range(first, last + 1)]
    finally:
        log.close()


def differences(reference: Path, run: Path) -> list[str]:
    """Where `run` (async) departs from `reference` (sync), step by step; empty when it reproduces it."""
    found = []
    expected, actual = read_metrics(reference), read_metrics(run)
    if [r["step"] for r in actual] != [r["step"] for r in expected]:
        return [f"steps {[r['step'] for r in actual]} instead of {[r['step'] for r in expected]}"]
    for want, got in zip(expected, actual):
        step = want["step"]
        groups = consumed_groups(run, got)
        if samples(groups) != samples(trained_groups(reference, step)):
            found.append(f"step {step}: other samples")
        stale = sum(v != step - 1 for g in groups for t in g.trajectories for v in t.token_versions)
        if stale:
            found.append(f"step {step}: {stale} trained tokens not sampled by version {step - 1} (staleness > 0)")
        found += [f"step {step}: {key} {got[key]} instead of {want[key]}" for key in COMPARED_METRICS if got[key] != want[key]]
    return found


def real_job(name: str, *mode: str):
    """The run `name` on the shared task files and model, as a job for `real_jobs`; returns its run directory."""
    def run(inputs: Path, _: Path) -> Path:
        done = asyncrl("run", *job(inputs, name, *mode))
        assert done.returncode == 0, done.stderr[-3000:]
        return inputs / "runs" / name

    run.__name__ = name.replace("-", "_")
    return run


LORA = ("model.lora.enabled=true", "model.lora.rank=8")  # the policy trained and served as a LoRA adapter
LORA_MISMATCH_KL = 1e-7  # per-token k3 KL(π_behav‖π_learner) at K = 0: float rounding only
RUNS = {"k0-sync": real_job("k0-sync", "learner.mode=synchronous"), "k0-async": real_job("k0-async", "buffer.max_staleness=0"),
        "k1-async": real_job("k1-async", "buffer.max_staleness=1"),
        "lora-k0-sync": real_job("lora-k0-sync", "learner.mode=synchronous", *LORA),
        "lora-k0-async": real_job("lora-k0-async", "buffer.max_staleness=0", *LORA)}
REAL_JOBS = list(RUNS.values())  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def runs(real_jobs) -> dict[str, Path]:
    return {name: real_jobs[run].result() for name, run in RUNS.items()}


def test_the_reference_trains_on_fresh_samples_with_a_loss(runs):
    records = read_metrics(runs["k0-sync"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        groups = trained_groups(runs["k0-sync"], record["step"])
        assert len(samples(groups)) == BATCH_GROUPS * SAMPLES_PER_GROUP
        assert {v for g in groups for t in g.trajectories for v in t.token_versions} == {record["step"] - 1}
        assert record["staleness/max"] == 0
        assert all(math.isfinite(record[key]) for key in COMPARED_METRICS)
        assert record["actor/grad_norm"] > 0  # an update at every step: the comparison is not vacuous
    assert len({r["actor/pg_loss"] for r in records}) == STEPS


def test_k0_reproduces_the_synchronous_reference(runs):
    assert differences(runs["k0-sync"], runs["k0-async"]) == []
    for record in read_metrics(runs["k0-async"]):
        assert record["batch/offset_max"] - record["batch/offset_min"] + 1 == BATCH_GROUPS  # none dropped, none skipped


def test_k1_does_not(runs):
    found = differences(runs["k0-sync"], runs["k1-async"])
    assert any("staleness > 0" in line for line in found), found


def test_with_lora_k0_reproduces_the_synchronous_reference(runs):
    """With the policy trained and served as a LoRA adapter (swapped in with vLLM's LoRA loading), K = 0 still
    reproduces the reference, whose engine loads the same adapters; and every trained token's behaviour log-prob is
    the learner's: the engine samples under the adapter the learner scores with, at every step, while it moves."""
    assert differences(runs["lora-k0-sync"], runs["lora-k0-async"]) == []
    lora, full = read_metrics(runs["lora-k0-async"]), read_metrics(runs["k0-async"])
    assert all(record["actor/grad_norm"] > 0 for record in lora)  # the adapter moves at every step
    assert [r["actor/grad_norm"] for r in lora] != [r["actor/grad_norm"] for r in full]  # adapters train, not the model
    # an engine left on the base (or on an older adapter) gave 0.89 at step 2
    assert all(record["rollout_corr/mismatch_kl"] < LORA_MISMATCH_KL for record in lora)
