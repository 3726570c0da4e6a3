"""Advantage estimators: sequence rewards [N] and groups (samples of one prompt) → per-token advantages [N, T].

Every estimator returns advantages that are 0 wherever the response mask is 0. Group statistics use every
sample of the group, whatever its mask. Registered by name in `ADVANTAGES`:
- grpo:   A_i = R_i - mean_g(R), divided by (std_g(R) + adv_eps) when `grpo_std_norm`
- rloo:   A_i = R_i - mean of the other samples of its group = n/(n-1) · (R_i - mean_g(R))
- reinforce_pp:           R_i on every token, whitened over the batch's masked tokens
- reinforce_pp_baseline:  R_i - mean_g(R) on every token, whitened over the batch's masked tokens
std is Bessel-corrected (torch.std). A sample alone in its group has no baseline: grpo and rloo give it 0
(there is no sibling to compare it with), and the group-baseline variant centres it to 0 before whitening.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch
from torch import Tensor

from asyncrl.config.algorithm import AlgorithmConfig
from learner.maths.loss_terms import masked_mean, masked_std
from learner.maths.registry import Registry

AdvantageEstimator = Callable[[Tensor, Tensor, Tensor, AlgorithmConfig], Tensor]  # (rewards, groups, mask, config)

ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator", "algorithm.advantage")
register_advantage = ADVANTAGES.register
get_advantage = ADVANTAGES.get


def compute_advantages(
    rewards: Tensor, groups: Tensor | Sequence[Hashable], response_mask: Tensor, config: AlgorithmConfig
) -> Tensor:
    """Per-token advantages [N, T] from the configured estimator, zero where `response_mask` is 0.

    `groups` is a group index per sample ([N] long) or any group id per sample (e.g. Trajectory.group_id).
    """
    estimator = get_advantage(config.advantage)
    group_index = as_group_index(groups, rewards.device)  # [N] long
    advantages = estimator(rewards.float(), group_index, response_mask, config)  # [N, T]
    return torch.where(response_mask.bool(), advantages, torch.zeros_like(advantages))  # [N, T]


def as_group_index(groups: Tensor | Sequence[Hashable], device: torch.device | None = None) -> Tensor:
    """[N] long: consecutive group numbers in order of first appearance (a tensor index is renumbered too)."""
    ids = groups.tolist() if isinstance(groups, Tensor) else list(groups)
    numbers: dict[Hashable, int] = {}
    return torch.tensor([numbers.setdefault(g, len(numbers)) for g in ids], dtype=torch.long, device=device)


@dataclass
class GroupStatistics:
    """Statistics of each sample's group, gathered back per sample."""

    size: Tensor  # [N] samples in the group
    mean: Tensor  # [N] mean reward of the group
    std: Tensor  # [N] Bessel-corrected std of the group's rewards (0 for a group of one)


def group_statistics(rewards: Tensor, group_index: Tensor) -> GroupStatistics:
    """Per-group size, mean and std of `rewards` [N], indexed back to each sample."""
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0

    def per_group_sum(values: Tensor) -> Tensor:
        return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add(0, group_index, values)

    size = per_group_sum(torch.ones_like(rewards))  # [G]
    mean = per_group_sum(rewards) / size  # [G]
    squared_deviation = (rewards - mean[group_index]).square()  # [N]
    std = (per_group_sum(squared_deviation) / (size - 1).clamp(min=1)).sqrt()  # [G]
    return GroupStatistics(size=size[group_index], mean=mean[group_index], std=std[group_index])


def broadcast_to_tokens(per_sample: Tensor, response_mask: Tensor) -> Tensor:
    """[N] → [N, T]: the sample's value on each of its masked tokens, 0 elsewhere."""
    values = per_sample[:, None].expand(response_mask.shape)  # [N, T]
    return torch.where(response_mask.bool(), values, torch.zeros_like(values))  # [N, T]


def whiten(values: Tensor, response_mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the masked tokens of the whole batch; 0 elsewhere."""
    whitened = (values - masked_mean(values, response_mask)) / (masked_std(values, response_mask) + eps)  # [N, T]
    return torch.where(response_mask.bool(), whitened, torch.zeros_like(whitened))  # [N, T]


@register_advantage("grpo")
def grpo(rewards: Tensor, group_index: Tensor, response_mask: Tensor, config: AlgorithmConfig) -> Tensor:
    """(R - group mean), divided by (group std + adv_eps) when `grpo_std_norm`; 0 for a group of one."""
    stats = group_statistics(rewards, group_index)
    centred = rewards - stats.mean  # [N]
    scaled = centred / (stats.std + config.adv_eps) if config.grpo_std_norm else centred  # [N]
    per_sample = torch.where(stats.size > 1, scaled, torch.zeros_like(scaled))  # [N]
    return broadcast_to_tokens(per_sample, response_mask)


@register_advantage("rloo")
def rloo(rewards: Tensor, group_index: Tensor, response_mask: Tensor, config: AlgorithmConfig) -> Tensor:
    """R_i minus the mean reward of the other samples of its group: n/(n-1)·(R_i - group mean); 0 when alone."""
    stats = group_statistics(rewards, group_index)
    leave_one_out = stats.size / (stats.size - 1).clamp(min=1) * (rewards - stats.mean)  # [N]
    per_sample = torch.where(stats.size > 1, leave_one_out, torch.zeros_like(leave_one_out))  # [N]
    return broadcast_to_tokens(per_sample, response_mask)


@register_advantage("reinforce_pp")
def reinforce_plus_plus(
    rewards: Tensor, group_index: Tensor, response_mask: Tensor, config: AlgorithmConfig
) -> Tensor:
    """REINFORCE++ with γ = 1 and the reward at the last token: every token's return is R, whitened over
    the batch's masked tokens. Groups are not used."""
    return whiten(broadcast_to_tokens(rewards, response_mask), response_mask, config.adv_eps)


@register_advantage("reinforce_pp_baseline")
def reinforce_plus_plus_baseline(
    rewards: Tensor, group_index: Tensor, response_mask: Tensor, config: AlgorithmConfig
) -> Tensor:
    """REINFORCE++-baseline: R - group mean on every token, then whitened over the batch's masked tokens."""
    stats = group_statistics(rewards, group_index)
    return whiten(broadcast_to_tokens(rewards - stats.mean, response_mask), response_mask, config.adv_eps)
