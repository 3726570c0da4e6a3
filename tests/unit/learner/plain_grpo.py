"""One GRPO optimizer step in plain PyTorch, written apart from `learner/` so that the learner's maths can be
checked against it: nothing here imports the learner's advantages, log-probs, losses, collate or train step.

It follows the learner's defaults (asyncrl/config/algorithm.py, asyncrl/config/learner.py): group-relative
advantages normalised by the group's std, the clipped PPO surrogate (`decoupled_ppo` or `naive_ppo`),
token_mean aggregation over the whole batch, gradient clipping by global norm, then one AdamW step from a
fresh optimizer state. Each sample runs through the model on its own, unpadded, and its log-probs come from
`log_softmax` of the model's logits: none of the learner's padding, packing, micro-batching or fused scoring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.learner import LearnerConfig

ADAM_EPS = 1e-8  # torch.optim.AdamW's default: the learner does not set eps
CLIP_NORM_EPS = 1e-6  # torch's clip_grad_norm_, which the learner calls, scales by max_norm / (norm + 1e-6)


@dataclass(frozen=True)
class Sample:
    prompt: list[int]
    completion: list[int]
    behaviour_logprobs: list[float]  # log π_behav of each completion token (ignored where the mask is 0)
    loss_mask: list[int]  # 1 = a model token to train on, 0 = an environment/tool token
    reward: float
    group: str


@dataclass
class PlainStep:
    loss: float
    grad_norm: float  # global L2 norm of the gradient before clipping
    gradients: dict[str, Tensor]  # after clipping, by parameter name
    parameters: dict[str, Tensor]  # after the AdamW step, by parameter name


def group_advantages(rewards: list[float], groups: list[str], eps: float) -> list[float]:
    """(R - group mean) / (group std + eps), std Bessel-corrected; 0 for a sample alone in its group.

    In float32, as the learner computes them: rewards travel as float32 and the learner's advantages stay in it."""
    advantages = [0.0] * len(rewards)
    for group in dict.fromkeys(groups):
        members = [i for i, g in enumerate(groups) if g == group]
        if len(members) < 2:
            continue
        values = torch.tensor([rewards[i] for i in members], dtype=torch.float32)  # [n]
        mean = values.sum() / len(members)  # []
        std = ((values - mean).square().sum() / (len(members) - 1)).sqrt()  # []
        for i, advantage in zip(members, ((values - mean) / (std + eps)).tolist()):
            advantages[i] = advantage
    return advantages


def completion_logprobs(model: torch.nn.Module, sample: Sample) -> Tensor:
    """log π(completion token j | everything before it), [n]: the logits at position P + j - 1 predict token j."""
    ids = torch.tensor([sample.prompt + sample.completion])  # [1, P + n]
    logits = model(input_ids=ids).logits[0]  # [P + n, V]
    log_probs = torch.log_softmax(logits, dim=-1)  # [P + n, V]
    start = len(sample.prompt) - 1
    predicting = log_probs[start:start + len(sample.completion)]  # [n, V]
    return predicting.gather(1, torch.tensor(sample.completion)[:, None])[:, 0]  # [n]


def token_losses(logprobs: Tensor, behaviour: Tensor, advantage: float, algorithm: AlgorithmConfig) -> Tensor:
    """Per-token loss, [n] → [n]. PPO's pessimistic surrogate on r = π_θ/π_anchor: the larger of -A·r and
    -A·clip(r); the clipped branch, when strictly larger, carries no gradient.
    decoupled_ppo: anchor π_prox (the weights before the update: log-probs detached), each token weighted by the
    fixed importance weight min(π_prox/π_behav, C). naive_ppo: anchor π_behav, weight 1."""
    if algorithm.loss == "decoupled_ppo":
        anchor = logprobs.detach()  # [n]
        weight = torch.exp(anchor - behaviour).clamp(max=algorithm.is_cap)  # [n]
    elif algorithm.loss == "naive_ppo":
        anchor, weight = behaviour, torch.ones_like(logprobs)  # [n] each
    else:
        raise ValueError(f"the plain step implements decoupled_ppo and naive_ppo, not {algorithm.loss}")
    ratio = torch.exp(logprobs - anchor)  # [n]
    clipped_ratio = ratio.clamp(1 - algorithm.clip_eps_low, 1 + algorithm.clip_eps_high)  # [n]
    unclipped_loss, clipped_loss = -advantage * ratio, -advantage * clipped_ratio  # [n] each
    return weight * torch.where(clipped_loss > unclipped_loss, clipped_loss, unclipped_loss)  # [n]


def policy_loss(logprobs: list[Tensor], behaviour: list[Tensor], masks: list[Tensor], advantages: list[float],
                algorithm: AlgorithmConfig) -> Tensor:
    """token_mean: the sum of every trained token's loss over the whole batch / the number of trained tokens.
    Samples are ragged, [n_i] each; a token with mask 0 adds to neither sum nor count."""
    if algorithm.aggregation != "token_mean":
        raise ValueError(f"the plain step implements token_mean aggregation, not {algorithm.aggregation}")
    total = sum(token_losses(lp, bp, a, algorithm)[m.bool()].sum() for lp, bp, m, a in zip(logprobs, behaviour, masks, advantages))
    return total / sum(int(m.sum()) for m in masks)


def clip_by_global_norm(gradients: list[Tensor], max_norm: float) -> tuple[list[Tensor], float]:
    """Gradients scaled down so that their global L2 norm is at most `max_norm` (0 = no clipping); the norm before."""
    norm = math.sqrt(sum(float(g.square().sum()) for g in gradients))
    if max_norm <= 0 or norm <= max_norm:
        return gradients, norm
    scale = max_norm / (norm + CLIP_NORM_EPS)
    return [g * scale for g in gradients], norm


def adamw_first_step(parameter: Tensor, gradient: Tensor, lr: float, weight_decay: float) -> Tensor:
    """AdamW's first step from zero moments. Bias correction makes the moment estimates g and g², so the step
    is lr · g / (|g| + eps), after the decoupled decay p · (1 - lr · weight_decay); β1 and β2 cancel out."""
    return parameter * (1 - lr * weight_decay) - lr * gradient / (gradient.abs() + ADAM_EPS)


def first_step_rate(settings: LearnerConfig) -> float:
    """The learning rate of the first optimizer step: lr, or lr / warmup_steps at the start of a linear warm-up."""
    return settings.lr / settings.warmup_steps if settings.warmup_steps else settings.lr


def grpo_step(model: torch.nn.Module, samples: list[Sample], algorithm: AlgorithmConfig,
              settings: LearnerConfig) -> PlainStep:
    """One optimizer step on `samples` from a fresh optimizer; `model` itself is left unchanged."""
    advantages = group_advantages([s.reward for s in samples], [s.group for s in samples], algorithm.adv_eps)
    dtype = next(model.parameters()).dtype
    logprobs = [completion_logprobs(model, s) for s in samples]
    behaviour = [torch.tensor(s.behaviour_logprobs, dtype=dtype) for s in samples]
    masks = [torch.tensor(s.loss_mask) for s in samples]
    loss = policy_loss(logprobs, behaviour, masks, advantages, algorithm)
    names, parameters = zip(*model.named_parameters())
    gradients, norm = clip_by_global_norm(list(torch.autograd.grad(loss, parameters)), settings.grad_clip)
    rate = first_step_rate(settings)
    updated = [adamw_first_step(p.detach(), g, rate, settings.weight_decay) for p, g in zip(parameters, gradients)]
    return PlainStep(loss=float(loss.detach()), grad_norm=norm, gradients=dict(zip(names, gradients)),
                     parameters=dict(zip(names, updated)))
