"""The learner's step divides the whole batch's loss by the count its aggregation names (docs/losses.md): trained
tokens for token_mean, sequences with at least one trained token for seq_mean_token_sum, those sequences times the
constant L (`algorithm.norm_tokens`) for seq_mean_token_sum_norm, in every case over the whole batch however it is cut
into micro-batches.

The case is worked out by hand whatever the model: behaviour log-probs of -100 put every importance weight
min(π_prox/π_behav, C) at C = 2, and with one optimizer step π_θ = π_prox, so decoupled_ppo's per-token loss is
-2·A. Group g: sample 1 (reward 1, two trained tokens) and sample 2 (reward 0, one), A = ±a with
a = 0.5 / (√0.5 + 1e-6) = 0.7071058. Group h: sample 3, alone (A = 0), whose only token is a tool token (mask 0).
    token sums: sample 1 -4a, sample 2 +2a, sample 3 nothing; total -2a
    token_mean:          -2a / 3 trained tokens          = -0.4714039
    seq_mean_token_sum:  -2a / 2 sequences with a token  = -0.7071058   (sample 3 has none: it does not count)
    seq_mean_token_sum_norm, L = 10:  -2a / (2 × 10)     = -0.0707106
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.messages import Trajectory, TrajectoryGroup
from learner.distributed import World
from learner.maths.batching import collate
from learner.policy.train_step import Passes, train_step
from policy_helpers import tiny_policy

FAR_OFF_POLICY = -100.0  # log π_behav: every importance weight is truncated at C


def sample(prompt: list[int], completion: list[int], mask: list[int], reward: float, group: str) -> Trajectory:
    return Trajectory(prompt, completion, [FAR_OFF_POLICY if m else 0.0 for m in mask], [0] * len(completion), mask,
                      reward, group, "arithmetic", "stop")


BATCH = [
    TrajectoryGroup("g", "g", "s", [sample([3, 4], [5, 6], [1, 1], 1.0, "g"), sample([3, 4], [7], [1], 0.0, "g")]),
    TrajectoryGroup("h", "h", "s", [sample([8, 9], [10], [0], 1.0, "h")]),
]


def step_loss(algorithm: AlgorithmConfig, micro_batch_tokens: int) -> float:
    model = tiny_policy()
    outcome = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), collate(BATCH, 0), algorithm,
                         Passes(micro_batch_tokens), 0.0, World(rank=0, size=1, device=torch.device("cpu")))
    return outcome.metrics["actor/pg_loss"]


@pytest.mark.parametrize("aggregation, expected", [("token_mean", -0.4714039), ("seq_mean_token_sum", -0.7071058),
                                                   ("seq_mean_token_sum_norm", -0.0707106)])
@pytest.mark.parametrize("micro_batch_tokens", [3, 1000])  # one row per pass, or the whole batch in one
def test_the_step_divides_by_the_whole_batchs_count(aggregation, expected, micro_batch_tokens):
    algorithm = AlgorithmConfig(aggregation=aggregation).resolved(max_tokens=10)
    assert step_loss(algorithm, micro_batch_tokens) == pytest.approx(expected, abs=1e-7)


def test_the_constant_length_is_rollouts_max_tokens_unless_set_and_a_step_refuses_an_unresolved_one():
    assert AlgorithmConfig().resolved(max_tokens=96).norm_tokens == 96
    assert AlgorithmConfig(norm_tokens=4096).resolved(max_tokens=96).norm_tokens == 4096
    with pytest.raises(ValueError, match="algorithm.norm_tokens"):
        step_loss(AlgorithmConfig(aggregation="seq_mean_token_sum_norm"), 1000)
