"""The learner loop with `buffer.max_staleness=auto` (one gloo rank, a tiny model, scripted batches): each
batch is asked for under the controller's current K, K per step is logged, the checkpoint keeps the current
K and a resumed run starts from it; a fixed `buffer.max_staleness` wins over a checkpoint's K."""

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.messages import Batch
from learner.loop_state import resume_state
from learner.policy.policy_model import load_policy
from learner_helpers import random_groups, save_tiny_model, single_rank_world
from offline_learner import OfflineConnections, run_offline

pytestmark = pytest.mark.slow

K_START = 3


def overrides(model_dir, *extra: str) -> list[str]:
    return [f"model.path={model_dir}", "learner.device=cpu", "learner.total_steps=2", "learner.checkpoint_every=2",
            "learner.lr=0.01", "rollout.sampling.n=2", "buffer.max_staleness=auto", "buffer.pacing.k_min=0",
            f"buffer.pacing.k_start={K_START}", "buffer.pacing.window=1", *extra]


def test_the_paced_k_reaches_each_batch_request_and_survives_a_resume(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    config = load_config(None, overrides(model_dir))
    asked: list[int] = []

    def fetch_batch(version: int, max_staleness: int) -> Batch:
        asked.append(max_staleness)
        # behaviour log-probs drawn in [-4, -0.5], far from the tiny model's: drift far above the 0.02 bound
        return Batch(groups=random_groups(version), offsets=[2 * version, 2 * version + 1], next_offset=2 * version + 2)

    with single_rank_world() as world:
        model = load_policy(str(model_dir), "float32", config.learner, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learner.lr)
        state = resume_state(config, tmp_path / "run", model, optimizer, world)
        assert state.max_staleness == K_START  # a new run starts at k_start
        connections = OfflineConnections(fetch_batch)
        run_offline(config, tmp_path / "run", world, model, optimizer, state, connections)
        logged = connections.logged
        assert asked == [3, 2]  # lowered by one after each one-step window, for drift
        assert [logged[v]["staleness/max_staleness"] for v in (1, 2)] == [3, 2]
        assert state.max_staleness == 1  # decided after step 2 and saved with its checkpoint
        resumed = resume_state(config, tmp_path / "run", model, optimizer, world)
        fixed = resume_state(load_config(None, overrides(model_dir, "buffer.max_staleness=2")), tmp_path / "run",
                             model, optimizer, world)
    assert (resumed.step, resumed.max_staleness) == (2, 1)
    assert (fixed.step, fixed.max_staleness) == (2, 2)
