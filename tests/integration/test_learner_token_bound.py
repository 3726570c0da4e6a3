"""`algorithm.max_token_staleness` in the learner loop (one gloo rank, a tiny model, scripted batches): the tokens
past the per-token bound are masked out of the loss, not the samples dropped. One step on a batch whose samples'
first tokens are old trains exactly what the same step trains with those tokens' loss mask already 0, the step's
record counts the masked share, and no trained token is staler than the bound."""

import dataclasses

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.messages import Batch, TrajectoryGroup
from learner.loop_state import LoopState
from learner.policy.policy_model import load_policy
from learner_helpers import gathered_weights, random_groups, save_tiny_model, single_rank_world
from offline_learner import OfflineConnections, run_offline

pytestmark = pytest.mark.slow

BOUND = 2  # algorithm.max_token_staleness
VERSION = 5  # the learner version that trains the batch
OLD = 2  # tokens of this version are 3 versions stale at VERSION: past the bound


def aged(groups: list[TrajectoryGroup], premasked: bool) -> list[TrajectoryGroup]:
    """Each sample's first two tokens sampled by version OLD, the rest by VERSION (a long response that ran through
    updates); with `premasked`, those two tokens already have loss mask 0."""
    def age(trajectory):
        n = len(trajectory.completion_ids)
        versions = [OLD] * 2 + [VERSION] * (n - 2)
        mask = [0] * 2 + [1] * (n - 2) if premasked else [1] * n
        logprobs = [0.0] * 2 + trajectory.behaviour_logprobs[2:] if premasked else trajectory.behaviour_logprobs
        return dataclasses.replace(trajectory, token_versions=versions, loss_mask=mask, behaviour_logprobs=logprobs)

    return [dataclasses.replace(group, trajectories=[age(t) for t in group.trajectories]) for group in groups]


def one_step(tmp_path, name: str, groups: list[TrajectoryGroup], bound: int) -> tuple[dict, dict]:
    """The weights after one step at VERSION on `groups` under the token bound `bound`, and the step's record."""
    model_dir = save_tiny_model(tmp_path / "model")
    config = load_config(None, [f"model.path={model_dir}", "learner.device=cpu", f"learner.total_steps={VERSION + 1}",
                                "learner.checkpoint_every=100", "learner.lr=0.01", "rollout.sampling.n=2",
                                f"algorithm.max_token_staleness={bound}", "buffer.max_staleness=8"])
    batch = Batch(groups=groups, offsets=[0, 1], next_offset=2)
    with single_rank_world() as world:
        model = load_policy(str(model_dir), "float32", config.learner, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learner.lr)
        connections = OfflineConnections(lambda version, k: batch)
        run_offline(config, tmp_path / name, world, model, optimizer, LoopState(step=VERSION, max_staleness=8), connections)
        return gathered_weights(model), connections.logged[VERSION + 1]


def test_tokens_past_the_bound_are_masked_out_of_the_loss_and_counted(tmp_path):
    groups = random_groups(seed=3)
    bounded, record = one_step(tmp_path, "bounded", aged(groups, premasked=False), BOUND)
    premasked, _ = one_step(tmp_path, "premasked", aged(groups, premasked=True), -1)
    assert all(torch.equal(bounded[name], premasked[name]) for name in bounded), "the same step as with those tokens masked"
    trained = sum(len(t.completion_ids) for g in groups for t in g.trajectories)
    assert record["staleness/masked_token_frac"] == pytest.approx(2 * 4 / trained)  # 2 tokens of each of 4 samples
    assert record["staleness/token_max"] == 0.0, "only the tokens of VERSION were trained"
    assert record["batch/samples"] == 4.0, "every sample trained"
