"""The study setting with real parts (buffer process, learner, one vLLM server): under
buffer.study_lag_versions = buffer.max_staleness = L every sample trained at version v was sampled by version
v − L (after the first L steps, which can only be v old), the servers get the weights of v − L, nothing is
dropped as stale, and the final version goes out as itself, so its validation sees the trained policy."""

from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics
from run_helpers import asyncrl, tiny_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LAG = 3
STEPS = 7


def overrides(inputs: Path, tmp: Path) -> list[str]:
    return tiny_job(
        inputs, STEPS, f"run.root_dir={tmp / 'runs'}", "run.name=lag", f"buffer.max_staleness={LAG}",
        f"buffer.study_lag_versions={LAG}", "buffer.batch_groups=2", "rollout.sampling.n=4", "rollout.max_inflight=8", "learner.checkpoint_every=100",
        f"validation.every={STEPS}", "validation.n=2", "validation.k=2", "validation.max_prompts=4",
    )


def lagged_job(inputs: Path, tmp: Path) -> list[dict]:
    done = asyncrl("run", *overrides(inputs, tmp))
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(tmp / "runs" / "lag")


REAL_JOBS = [lagged_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def lagged_run(real_jobs):
    return real_jobs[lagged_job].result()


def test_every_trained_sample_is_exactly_the_lag_old_after_the_warm_up(lagged_run):
    steps = [r for r in lagged_run if r.get("staleness/min") is not None]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # step s trains at version s − 1; its samples came from version max(0, s − 1 − LAG)
    expected = [min(step - 1, LAG) for step in range(1, STEPS + 1)]
    assert [(r["staleness/min"], r["staleness/max"]) for r in steps] == [(float(k), float(k)) for k in expected]
    assert all(r["buffer/dropped_stale_in_batch"] == 0 for r in steps)


def test_the_servers_get_the_weights_lag_versions_back_and_the_final_ones_as_themselves(lagged_run):
    sent = [r["weight_sync/version_sent"] for r in lagged_run if "weight_sync/version_sent" in r]
    assert sent == [float(max(0, step - LAG)) for step in range(1, STEPS)] + [float(STEPS)]
    validated = [r["val/version"] for r in lagged_run if r.get("val/score/mean") is not None]
    assert validated[-1] == STEPS
