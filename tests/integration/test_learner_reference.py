"""A learner run with a frozen reference model and a warm-up: the KL to the reference is 0 at the first
step (the policy starts as the reference) and grows as the policy moves; `actor/lr` rises linearly. With LoRA the
reference is the policy's own base, its adapters switched off (no second copy)."""

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.messages import Batch
from learner.loop_state import LoopState
from learner.policy.lora import AdaptersOff
from learner.policy.policy_model import load_policy, load_reference
from learner_helpers import random_groups, save_tiny_model, single_rank_world
from offline_learner import OfflineConnections, run_offline

pytestmark = pytest.mark.slow

STEPS, WARMUP, LR = 4, 3, 0.01


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_kl_to_the_reference_starts_at_zero_and_grows_while_the_rate_warms_up(tmp_path, lora):
    model_dir = save_tiny_model(tmp_path / "model")
    config = load_config(overrides=[
        f"learner.total_steps={STEPS}", f"learner.warmup_steps={WARMUP}", f"learner.lr={LR}", "learner.device=cpu",
        f"model.path={model_dir}", "model.dtype=float32", "algorithm.use_reference=true", "algorithm.kl_coef=0.1",
        f"model.lora.enabled={lora}", "model.lora.rank=4",
    ])
    batches = iter(Batch(groups=random_groups(step, groups=2, samples=4), offsets=[2 * step, 2 * step + 1],
                         next_offset=2 * step + 2) for step in range(STEPS))
    connections = OfflineConnections(lambda version, max_staleness: next(batches))
    with single_rank_world() as world:
        model = load_policy(str(model_dir), "float32", config.learner, world, config.model.lora)
        reference = load_reference(config, world, model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        run_offline(config, tmp_path / "run", world, model, optimizer, LoopState(), connections, reference)
    logged = connections.logged
    kl = [logged[version]["actor/kl_loss"] for version in range(1, STEPS + 1)]
    assert kl[0] == 0.0  # the policy before its first update is the reference, token for token
    assert all(value > 0 for value in kl[1:]) and kl[-1] > kl[1]
    assert [logged[v]["actor/lr"] for v in range(1, STEPS + 1)] == pytest.approx([LR / 3, 2 * LR / 3, LR, LR])
    if lora:
        assert isinstance(reference, AdaptersOff) and reference.policy is model
    else:
        assert all(not p.requires_grad for p in reference.parameters())
