"""Synchronous RL colocated on every GPU the job gets (`learner.mode=synchronous`, `learner.nproc=2`; on CPU, two
ranks over gloo, each with its own vLLM CPU engine): each rank samples its share of a step's prompts, both train one
FSDP2 step on the pooled batch, and each loads the new weights into its own engine. With seeded sampling it trains
what the one-process reference trains (test_k0_matches_reference.py's `k0-sync` run, the same job on one rank):
the same groups, token for token, at every step, and the same losses up to float rounding (the ranks sum a step's
loss in another order, so from step 2 on the weights, and the log-probs the engines report, differ in the last bits).

The two-rank run also keeps the weights of its due versions (`validation.after_run`): rank 0 writes them, and
gathering the first ones is a collective that every rank joins (a rank left out would leave the others waiting).
Another two-rank run validates during the run: each rank scores its half of the held-out prompts on its own engine,
and rank 0 records the pooled pass."""

from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics
from asyncrl.snapshots import made_times
from launch.reference_loop import trained_groups
from test_k0_matches_reference import RUNS, STEPS, real_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.extended]

ONE_RANK = RUNS["k0-sync"]  # the same job object: the session runs it once for both modules
TWO_RANKS = real_job("colocated-sync-2", "learner.mode=synchronous", "learner.nproc=2", "validation.every=3",
                     "validation.after_run=true")
VALIDATING = real_job("colocated-sync-2-validating", "learner.mode=synchronous", "learner.nproc=2", "validation.every=3")
REAL_JOBS = [ONE_RANK, TWO_RANKS, VALIDATING]
HELD_OUT = 16  # the shared task's held-out prompts (tiny_job: task.num_val)
LOSS_TOLERANCE = 1e-6  # |Δ actor/pg_loss|: seen 3e-8 (a float32 sum in another order)
GRAD_NORM_TOLERANCE = 1e-5  # relative: seen 7e-7
LOGPROB_TOLERANCE = 1e-5  # |Δ| of a behaviour log-prob: seen 0 at step 1 (the same weights), 1e-6 after


@pytest.fixture(scope="module")
def runs(real_jobs) -> tuple[Path, Path]:
    return real_jobs[ONE_RANK].result(), real_jobs[TWO_RANKS].result()


def tokens(run: Path, step: int) -> list[tuple]:
    """Each trained sample of `step` in sampling order: group id, prompt and completion ids, reward."""
    return [(g.group_id, tuple(t.prompt_ids), tuple(t.completion_ids), t.reward)
            for g in trained_groups(run, step) for t in g.trajectories]


def logprobs(run: Path, step: int) -> list[float]:
    return [value for g in trained_groups(run, step) for t in g.trajectories for value in t.behaviour_logprobs]


def test_two_colocated_ranks_train_the_groups_one_rank_trains_with_the_same_losses(runs):
    one, two = runs
    expected, actual = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in actual] == [r["step"] for r in expected] == list(range(1, STEPS + 1))
    for want, got in zip(expected, actual):
        step = want["step"]
        assert tokens(two, step) == tokens(one, step)
        assert len(tokens(two, step)) == 16  # 4 groups of 4, two from each rank
        assert logprobs(two, step) == pytest.approx(logprobs(one, step), abs=LOGPROB_TOLERANCE)
        assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], abs=LOSS_TOLERANCE)
        assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=GRAD_NORM_TOLERANCE)
        assert got["actor/grad_norm"] > 0 and got["critic/score/mean"] == want["critic/score/mean"]
        assert got.keys() == want.keys()  # rank 0 records what the one-process reference records


def test_each_rank_loads_every_version_into_its_own_engine_and_rank_0_alone_records(runs):
    _, two = runs
    for rank in (0, 1):
        log = (two / "logs" / f"reference{rank}.log").read_text()
        loaded = [version for version in range(1, STEPS + 1) if f"weights updated to version {version};" in log]
        assert loaded == [1, 2, 3], rank
    assert sorted(made_times(two)) == [0, 3]  # versions due every 3 steps, kept by rank 0 once
    assert len(read_metrics(two)) == STEPS  # one record a step, not one per rank


def test_a_pass_during_the_run_is_split_between_the_ranks_engines_and_recorded_once(real_jobs):
    run = real_jobs[VALIDATING].result()
    passes = [(r["step"], r["val/version"], r["val/prompts"]) for r in read_metrics(run) if "val/version" in r]
    assert passes == [(0, 0.0, HELD_OUT), (3, 3.0, HELD_OUT)]  # every held-out prompt, once a pass
    for rank in (0, 1):
        log = (run / "logs" / f"reference{rank}.log").read_text()
        for version in (0, 3):
            assert f"validating version {version}: {HELD_OUT // 2} of the {HELD_OUT} held-out prompts" in log, rank
