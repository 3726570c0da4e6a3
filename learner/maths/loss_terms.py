"""Building blocks the policy losses share: masked reductions, the PPO clip, importance-weight
truncation, KL estimators, the behaviour-anchored trust regions' masks, aggregation and per-token entropy.

Shapes: B sequences, T completion tokens, V vocabulary, [] a scalar. A mask is 1 where a token is trained
on and 0 on environment/tool tokens and padding. Every reduction selects with the mask (never multiplies
by it): any finite value at a masked position changes neither values nor gradients, and even a NaN or an
infinity there cannot reach a loss or metric value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# |log ratio| is clamped to this before exp: e^20 ≈ 5e8 lies far past any clip range or IS cap, so no
# value the losses use changes, while exp stays finite (an inf ratio times a zero advantage is NaN)
LOG_RATIO_LIMIT = 20.0

TOKEN_MEAN = "token_mean"  # sum over all trained tokens / number of trained tokens
SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"  # each sequence's token sum, averaged over sequences
# Dr. GRPO: each sequence's token sum over a constant length L, averaged over sequences: a token weighs the same
# whatever the lengths of the batch it came in
SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"
AGGREGATIONS = (TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_SUM_NORM)

KL_ESTIMATORS = ("k1", "k3")


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is set, over `dim` (all dimensions when None)."""
    selected = torch.where(mask.bool(), values, torch.zeros_like(values))  # [B, T]
    return selected.sum() if dim is None else selected.sum(dim)


def mask_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of set mask entries, over `dim` (all dimensions when None)."""
    flags = mask.bool().float()  # [B, T]
    return flags.sum() if dim is None else flags.sum(dim)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over the set mask entries; 0 when the mask is empty."""
    return masked_sum(values, mask) / mask_count(mask).clamp(min=1)


def masked_std(values: Tensor, mask: Tensor) -> Tensor:
    """Standard deviation (Bessel-corrected, like torch.std) of `values` over the set mask entries."""
    deviation = values - masked_mean(values, mask)  # [B, T]
    bessel_count = (mask_count(mask) - 1).clamp(min=1)  # []
    return (masked_sum(deviation.square(), mask) / bessel_count).sqrt()


def ratio_from_log(log_ratio: Tensor) -> Tensor:
    """exp(log_ratio), with the log ratio clamped to ±LOG_RATIO_LIMIT so that it stays finite."""
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()


@dataclass
class ClippedSurrogate:
    """PPO's pessimistic surrogate per token, and where its clipped branch is the active one."""

    loss: Tensor  # [B, T] max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high))
    clipped: Tensor  # [B, T] bool: the clipped branch is strictly larger, so this token has no gradient


def clipped_surrogate(
    logprobs: Tensor, anchor_logprobs: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> ClippedSurrogate:
    """PPO clip on r = π_θ/π_anchor, with separate ε below and above 1 (clip-higher when ε_high > ε_low).

    The anchor is a fixed reference point (π_prox or π_behav): it is detached, no gradient flows to it.
    """
    ratio = ratio_from_log(logprobs - anchor_logprobs.detach())  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    return ClippedSurrogate(loss=torch.maximum(unclipped, clipped), clipped=clipped > unclipped)


@dataclass
class Correction:
    """The per-token weight an off-policy correction applies, and where it changed the token's weight."""

    weight: Tensor  # [B, T] detached weight multiplying the token's loss
    changed: Tensor  # [B, T] bool: truncated at the cap, or dropped


def truncated_weight(log_ratio: Tensor, cap: float) -> Correction:
    """min(exp(log_ratio), cap), detached: the weight rescales the gradient and never receives one."""
    ratio = ratio_from_log(log_ratio.detach())  # [B, T]
    return Correction(weight=ratio.clamp(max=cap), changed=ratio > cap)


def k3_from_log_ratio(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 term (r - 1) - log r, r = exp(log_ratio): with samples from q and r = p/q, an
    unbiased, non-negative estimate of KL(q‖p)."""
    clamped = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [B, T]
    return clamped.exp() - 1.0 - clamped


def binary_kl(behaviour_logprobs: Tensor, logprobs: Tensor) -> Tensor:
    """Per token, KL(Bern(μ)‖Bern(π)) for μ = π_behav(token), π = π_θ(token): the divergence between the two
    policies restricted to "this token or any other", DPPO's cheap stand-in for the full-vocabulary KL:
        μ·(log μ − log π) + (1 − μ)·(log(1 − μ) − log(1 − π)).
    log(1 − p) is floored at −LOG_RATIO_LIMIT, so a probability of exactly 1 gives a finite value."""
    log_mu = behaviour_logprobs.clamp(-LOG_RATIO_LIMIT, 0.0)  # [B, T]
    log_pi = logprobs.clamp(-LOG_RATIO_LIMIT, 0.0)  # [B, T]
    mu = log_mu.exp()  # [B, T]
    return mu * (log_mu - log_pi) + (1.0 - mu) * (_log_one_minus(log_mu) - _log_one_minus(log_pi))


def _log_one_minus(log_p: Tensor) -> Tensor:
    """log(1 − p) from log p ≤ 0, floored at −LOG_RATIO_LIMIT."""
    return torch.log(-torch.expm1(log_p)).clamp(min=-LOG_RATIO_LIMIT)


def leaves_trust_region(divergence: Tensor, bound: float, shift: Tensor, advantages: Tensor) -> Tensor:
    """[B, T] bool, DPPO's mask: the token lies past the bound (divergence > bound) and its advantage pushes its
    probability further the way it has already moved (A · shift > 0, shift = π_θ − π_behav). An update back
    toward π_behav is never masked, nor is a token with A = 0."""
    return (divergence > bound) & (advantages * shift > 0)


def second_moment_cutoff(squared_log_ratios: Tensor, threshold: float) -> float:
    """M2PO's cutoff c over one optimizer step's trained tokens ([N] values s = (log ratio)²): keeping the
    tokens with s ≤ c, and masking the ones above it, keeps as many tokens as possible (the smallest s first)
    while their mean s stays at most `threshold`. Equal values are kept or masked together. -inf (mask every
    token) when even the smallest s exceeds the threshold; +inf (mask none) when there are no tokens."""
    if squared_log_ratios.numel() == 0:
        return math.inf
    ascending = squared_log_ratios.detach().double().flatten().sort().values  # [N]
    counts = torch.arange(1, ascending.numel() + 1, dtype=ascending.dtype, device=ascending.device)  # [N]
    prefix_mean = ascending.cumsum(0) / counts  # [N] non-decreasing: each added value is the largest so far
    last_of_its_value = torch.ones_like(ascending, dtype=torch.bool)  # [N]
    last_of_its_value[:-1] = ascending[1:] > ascending[:-1]
    admissible = (last_of_its_value & (prefix_mean <= threshold)).nonzero()  # [k, 1]
    return float(ascending[admissible.max()]) if admissible.numel() else -math.inf


def kl_estimate(logprobs: Tensor, reference_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) on tokens sampled from π_θ:
    k1 = log π_θ - log π_ref;  k3 = (r - 1) - log r with r = π_ref/π_θ."""
    if estimator == "k1":
        return logprobs - reference_logprobs  # [B, T]
    if estimator == "k3":
        return k3_from_log_ratio(reference_logprobs - logprobs)  # [B, T]
    raise ValueError(f"algorithm.kl_estimator: '{estimator}' is not one of {list(KL_ESTIMATORS)}")


def aggregate(per_token: Tensor, mask: Tensor, mode: str, denominator: float | None = None) -> Tensor:
    """One scalar from per-token values [B, T].

    token_mean: Σ masked values / number of masked tokens.
    seq_mean_token_sum: Σ over sequences of (Σ masked values of the sequence) / number of sequences that
    have at least one masked token.
    seq_mean_token_sum_norm: the same over (those sequences × L), L a constant length: the learner passes it in
    `denominator`; without one, the most trained tokens of a sequence here stand for L.
    `denominator` replaces the count (tokens or sequences) when this tensor is one micro-batch of a larger
    batch, so that micro-batch losses add up to the loss of the whole batch.
    """
    if mode == TOKEN_MEAN:
        count = mask_count(mask)  # [] trained tokens
    elif mode == SEQ_MEAN_TOKEN_SUM:
        count = (mask_count(mask, dim=-1) > 0).float().sum()  # [] sequences with a trained token
    elif mode == SEQ_MEAN_TOKEN_SUM_NORM:
        per_sequence = mask_count(mask, dim=-1)  # [B] trained tokens
        count = (per_sequence > 0).float().sum() * per_sequence.max()  # [] those sequences × the longest
    else:
        raise ValueError(f"algorithm.aggregation: '{mode}' is not one of {list(AGGREGATIONS)}")
    total = masked_sum(per_token, mask)  # []
    return total / (denominator if denominator is not None else count.clamp(min=1))


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution at every position, in nats: [B, T, V] → [B, T]."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    return -(log_probs.exp() * log_probs).sum(dim=-1)  # [B, T]
