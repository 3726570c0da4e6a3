"""Advantage estimators against values worked out by hand: GRPO (with and without std), RLOO, REINFORCE++,
groups of one, masks, group ids, and user estimators from a file."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config.algorithm import AlgorithmConfig
from learner.maths.advantages import ADVANTAGES, as_group_index, compute_advantages, get_advantage, grpo
from learner.maths.registry import RegistryError
from tests.fixture_files import CUSTOM_LOSSES

ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
TOLERANCE = 1e-5  # adv_eps = 1e-6 in the denominators shifts values by about that much

# six samples in three groups: a = {1, 0, 0}, b = {2} (alone), c = {5, 3}
REWARDS = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0, 3.0])
GROUPS = ["a", "a", "a", "b", "c", "c"]
FULL_MASK = torch.ones(6, 2)


def per_sample(advantages: torch.Tensor) -> list[float]:
    """The advantage of each sample, read from its first token (all its trained tokens carry the same)."""
    return advantages[:, 0].tolist()


def test_grpo_with_std_normalisation():
    # a: mean 1/3, std = sqrt(((2/3)² + 2·(1/3)²) / 2) = sqrt(1/3) → [2/3, -1/3, -1/3] · √3
    # b: alone → 0
    # c: mean 4, std = sqrt((1² + 1²) / 1) = √2 → [1/√2, -1/√2]
    advantages = compute_advantages(REWARDS, GROUPS, FULL_MASK, AlgorithmConfig(advantage="grpo"))
    root3, root2 = math.sqrt(3), math.sqrt(2)
    expected = [2 / 3 * root3, -1 / 3 * root3, -1 / 3 * root3, 0.0, 1 / root2, -1 / root2]
    assert per_sample(advantages) == pytest.approx(expected, abs=TOLERANCE)
    assert torch.equal(advantages[:, 0], advantages[:, 1])


def test_grpo_without_std_normalisation():
    # R - group mean: a → [2/3, -1/3, -1/3], b → 0, c → [1, -1]
    config = AlgorithmConfig(advantage="grpo", grpo_std_norm=False)
    advantages = compute_advantages(REWARDS, GROUPS, FULL_MASK, config)
    assert per_sample(advantages) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 1.0, -1.0])


def test_grpo_group_with_equal_rewards_gives_zero_not_nan():
    # std 0: (R - mean) / (0 + eps) = 0 / eps = 0
    advantages = compute_advantages(torch.ones(3), ["g", "g", "g"], torch.ones(3, 2), AlgorithmConfig())
    assert advantages.abs().sum().item() == 0.0


def test_rloo():
    # R_i - mean of the others: a → [1 - 0, 0 - 1/2, 0 - 1/2], b → alone 0, c → [5 - 3, 3 - 5]
    advantages = compute_advantages(REWARDS, GROUPS, FULL_MASK, AlgorithmConfig(advantage="rloo"))
    assert per_sample(advantages) == pytest.approx([1.0, -0.5, -0.5, 0.0, 2.0, -2.0])


def test_reinforce_plus_plus_whitens_over_masked_tokens():
    # R = [1, 3], tokens trained: sample 1 two, sample 2 one → token returns [1, 1, 3]
    # mean 5/3, deviations [-2/3, -2/3, 4/3], var = (4/9 + 4/9 + 16/9) / (3 - 1) = 4/3, std = 2/√3
    # → [-1/√3, -1/√3, 2/√3]; the masked token stays 0
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    config = AlgorithmConfig(advantage="reinforce_pp")
    advantages = compute_advantages(torch.tensor([1.0, 3.0]), ["x", "x"], mask, config)
    root3 = math.sqrt(3)
    assert advantages.flatten().tolist() == pytest.approx([-1 / root3, -1 / root3, 2 / root3, 0.0], abs=TOLERANCE)


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_first():
    # groups a = {1, 3}, b = {10}: centred [-1, 1, 0]; tokens (mask) [-1, -1, 1, 1, 0]
    # mean 0, var = (1 + 1 + 1 + 1 + 0) / (5 - 1) = 1 → unchanged
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    config = AlgorithmConfig(advantage="reinforce_pp_baseline")
    advantages = compute_advantages(torch.tensor([1.0, 3.0, 10.0]), ["a", "a", "b"], mask, config)
    assert advantages.flatten().tolist() == pytest.approx([-1.0, -1.0, 1.0, 1.0, 0.0, 0.0], abs=TOLERANCE)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantages_are_zero_where_the_mask_is_zero(estimator):
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    advantages = compute_advantages(REWARDS, GROUPS, mask, AlgorithmConfig(advantage=estimator))
    assert advantages.shape == (6, 2)
    assert advantages[mask == 0].abs().sum().item() == 0.0
    assert all(math.isfinite(value) for value in advantages.flatten().tolist())


def test_group_ids_and_group_index_give_the_same_advantages():
    assert as_group_index(["x", "y", "x", "z"]).tolist() == [0, 1, 0, 2]
    assert as_group_index(torch.tensor([7, 3, 7])).tolist() == [0, 1, 0]
    by_id = compute_advantages(REWARDS, GROUPS, FULL_MASK, AlgorithmConfig())
    by_index = compute_advantages(REWARDS, torch.tensor([4, 4, 4, 9, 2, 2]), FULL_MASK, AlgorithmConfig())
    assert torch.equal(by_id, by_index)


def test_registry_names_and_a_user_estimator_from_a_file():
    assert set(ESTIMATORS) <= set(ADVANTAGES.names())
    assert get_advantage("grpo") is grpo
    mask = torch.tensor([[1.0, 0.0]])
    config = AlgorithmConfig(advantage=f"{CUSTOM_LOSSES}:constant_advantage")
    # the estimator fills 7 everywhere; compute_advantages zeroes the masked token
    assert compute_advantages(torch.tensor([1.0]), ["g"], mask, config).tolist() == [[7.0, 0.0]]


def test_unknown_estimator_is_named_with_its_config_key():
    with pytest.raises(RegistryError, match=r"algorithm.advantage: advantage estimator 'gae'.*registered: grpo"):
        compute_advantages(REWARDS, GROUPS, FULL_MASK, AlgorithmConfig(advantage="gae"))
