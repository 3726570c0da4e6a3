"""Policy losses: pure functions from per-token log-probs, advantages and a loss mask to a scalar loss and a
dict of float metrics (verl's names, plus `rollout_corr/*` for the off-policy correction).

Notation per token: π_θ the policy being trained (carries the gradient), π_behav the policy that sampled
(reported by the rollout engine), π_prox the learner's policy before this update (recomputed by the
learner), A the advantage, m the loss mask, C = `is_cap`, ε_low/ε_high the clip range, and
    r = π_θ/π_anchor,   clip(r) = clamp(r, 1 - ε_low, 1 + ε_high),
    ℓ_clip(r) = max(-A·r, -A·clip(r))                     (PPO's pessimistic surrogate).
Every mode is aggregated over m by `algorithm.aggregation` (token_mean or seq_mean_token_sum). Weights
written sg(·) are detached: they scale the gradient and never receive one. docs/losses.md has the details.

Modes, registered by name in `LOSSES`:
- decoupled_ppo: sg(min(π_prox/π_behav, C)) · ℓ_clip(π_θ/π_prox)      (AReaL's decoupled PPO)
- tis:           -sg(min(π_θ/π_behav, C)) · A · log π_θ             (truncated IS policy gradient)
- seq_mask:      ℓ_clip(π_θ/π_prox) on sequences whose ratio π_prox/π_behav lies in
                 [seq_mask_low, seq_mask_high]; other sequences are dropped from the loss
- naive_ppo:     ℓ_clip(π_θ/π_behav)                                 (no correction; for ablations)
Behaviour-anchored trust regions: each bounds how far π_θ (m2po: π_prox) stands from π_behav, the policy that
sampled, and not only from π_prox; ρ = π_θ/π_behav, and a masked token adds 0 but stays in the count:
- dppo_tv:       −κ·A·ρ, κ = 0 where |π_θ − π_behav| > δ_tv and A pushes further out   (DPPO-Binary-TV)
- dppo_kl:       −κ·A·ρ, κ = 0 where KL(Bern(π_behav)‖Bern(π_θ)) > δ_kl, likewise     (DPPO-Binary-KL)
- m2po:          −κ·A·ρ, κ = 0 on the largest (log π_prox − log π_behav)² until their mean is ≤ τ  (M2PO)
- decoupled_ppo_kl: decoupled_ppo + β·KL(π_behav‖π_θ), KL by k3 on the sampled tokens
`compute_policy_loss` runs the configured mode and adds the KL penalty and the entropy metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from asyncrl.config.algorithm import AlgorithmConfig
from learner.maths.loss_terms import (
    Correction,
    aggregate,
    binary_kl,
    clipped_surrogate,
    k3_from_log_ratio,
    kl_estimate,
    leaves_trust_region,
    masked_mean,
    masked_sum,
    mask_count,
    ratio_from_log,
    second_moment_cutoff,
    truncated_weight,
)
from learner.maths.registry import Registry


@dataclass
class LossInputs:
    """Per-token tensors of one (micro-)batch. Only `logprobs` carries a gradient. The learner's log-probs and
    entropies are computed where `loss_mask` is 1 only, and hold 0 elsewhere (`learner.maths.logprobs.target_logprobs`)."""

    logprobs: Tensor  # [B, T] log π_θ(token) under the weights being trained
    behaviour_logprobs: Tensor  # [B, T] log π_behav(token) reported by the rollout engine
    advantages: Tensor  # [B, T] advantage per token (0 where loss_mask is 0)
    loss_mask: Tensor  # [B, T] 1 = train on the token; 0 = environment/tool token or padding
    proximal_logprobs: Tensor | None = None  # [B, T] log π_prox recomputed before the update (decoupled_ppo, seq_mask, m2po, decoupled_ppo_kl)
    reference_logprobs: Tensor | None = None  # [B, T] log π_ref of a frozen reference model (use_reference)
    entropy: Tensor | None = None  # [B, T] entropy of π_θ per position (metric only; see token_entropy)
    denominator: float | None = None  # tokens or sequences of the optimizer step's whole (mini-)batch when this is a micro-batch of it
    m2_cutoff: float | None = None  # m2po: the cutoff c over the whole optimizer step's tokens; None = from these tokens alone


Metrics = dict[str, float]
LossResult = tuple[Tensor, Metrics]  # (scalar loss, metrics)
PolicyLoss = Callable[[LossInputs, AlgorithmConfig], LossResult]

GEOMETRIC_MEAN = "geometric_mean"  # seq_mask: exp(mean log ratio) of the sequence's trained tokens
WORST_TOKEN = "worst_token"  # seq_mask: every trained token's ratio on its own
SEQ_MASK_STATISTICS = (GEOMETRIC_MEAN, WORST_TOKEN)

LOSSES: Registry[PolicyLoss] = Registry("loss", "algorithm.loss")
register_loss = LOSSES.register
get_loss = LOSSES.get


def compute_policy_loss(inputs: LossInputs, config: AlgorithmConfig) -> LossResult:
    """The configured policy loss, plus kl_coef · KL(π_θ‖π_ref) when `use_reference`, and the entropy metric."""
    loss, metrics = get_loss(config.loss)(inputs, config)
    if config.use_reference:
        kl_loss = reference_kl(inputs, config)  # []
        loss = loss + config.kl_coef * kl_loss  # []
        metrics["actor/kl_loss"] = kl_loss.item()
        metrics["actor/kl_coef"] = config.kl_coef
    if inputs.entropy is not None:
        metrics["actor/entropy"] = masked_mean(inputs.entropy.detach(), inputs.loss_mask).item()
    return loss, metrics


def reference_kl(inputs: LossInputs, config: AlgorithmConfig) -> Tensor:
    """KL(π_θ‖π_ref) estimated per token (k1 or k3), aggregated like the policy loss."""
    reference = _required(inputs.reference_logprobs, "reference_logprobs", "algorithm.use_reference=true")  # [B, T]
    per_token = kl_estimate(inputs.logprobs, reference, config.kl_estimator)  # [B, T]
    return aggregate(per_token, inputs.loss_mask, config.aggregation, inputs.denominator)


@register_loss("decoupled_ppo")
def decoupled_ppo(inputs: LossInputs, config: AlgorithmConfig) -> LossResult:
    """sg(min(π_prox/π_behav, C)) · ℓ_clip(π_θ/π_prox): the clip keeps the update near π_prox, the truncated
    weight corrects for sampling from the older π_behav."""
    proximal = _required(inputs.proximal_logprobs, "proximal_logprobs", "loss 'decoupled_ppo'")  # [B, T]
    log_ratio = proximal - inputs.behaviour_logprobs  # [B, T]
    correction = truncated_weight(log_ratio, config.is_cap)  # [B, T] weights
    loss, metrics = _weighted_ppo(inputs, config, proximal, correction.weight, inputs.loss_mask)
    metrics.update(_rollout_metrics(log_ratio, correction, inputs.loss_mask))
    return loss, metrics


@register_loss("tis")
def truncated_importance_sampling(inputs: LossInputs, config: AlgorithmConfig) -> LossResult:
    """-sg(min(π_θ/π_behav, C)) · A · log π_θ: the off-policy policy gradient min(ρ, C)·A·∇log π_θ with no
    proximal pass and no clip. Truncation is its only bound: `actor/pg_clipfrac` is the truncated share."""
    log_ratio = inputs.logprobs - inputs.behaviour_logprobs  # [B, T]
    correction = truncated_weight(log_ratio, config.is_cap)  # [B, T] weights
    per_token = -correction.weight * inputs.advantages * inputs.logprobs  # [B, T]
    loss = aggregate(per_token, inputs.loss_mask, config.aggregation, inputs.denominator)  # []
    metrics = {
        "actor/pg_loss": loss.item(),
        "actor/pg_clipfrac": masked_mean(correction.changed.float(), inputs.loss_mask).item(),
        "actor/ppo_kl": _mean_log_ratio(inputs, inputs.behaviour_logprobs, inputs.loss_mask),
    }
    metrics.update(_rollout_metrics(log_ratio, correction, inputs.loss_mask))
    return loss, metrics


@register_loss("seq_mask")
def sequence_masked_ppo(inputs: LossInputs, config: AlgorithmConfig) -> LossResult:
    """ℓ_clip(π_θ/π_prox) on the sequences whose IS ratio π_prox/π_behav lies in [seq_mask_low, seq_mask_high];
    the others leave the loss, and its denominator too unless `inputs.denominator` fixes it (the learner's
    micro-batched step counts the whole batch's trained tokens there, dropped sequences included)."""
    proximal = _required(inputs.proximal_logprobs, "proximal_logprobs", "loss 'seq_mask'")  # [B, T]
    log_ratio = proximal - inputs.behaviour_logprobs  # [B, T]
    keep = sequences_within_ratio_bounds(log_ratio, inputs.loss_mask, config)  # [B] bool
    kept_mask = inputs.loss_mask.bool() & keep[:, None]  # [B, T]
    loss, metrics = _weighted_ppo(inputs, config, proximal, torch.ones_like(proximal), kept_mask)
    correction = Correction(weight=kept_mask.float(), changed=~kept_mask)  # [B, T] 0/1 weights
    metrics.update(_rollout_metrics(log_ratio, correction, inputs.loss_mask))
    return loss, metrics


@register_loss("naive_ppo")
def naive_ppo(inputs: LossInputs, config: AlgorithmConfig) -> LossResult:
    """ℓ_clip(π_θ/π_behav): PPO as if the samples came from the learner's own policy (no correction)."""
    unit_weight = torch.ones_like(inputs.logprobs)  # [B, T]
    loss, metrics = _weighted_ppo(inputs, config, inputs.behaviour_logprobs, unit_weight, inputs.loss_mask)
    uncorrected = Correction(weight=unit_weight, changed=torch.zeros_like(unit_weight, dtype=torch.bool))  # [B, T]
    log_ratio = inputs.logprobs - inputs.behaviour_logprobs  # [B, T]
    metrics.update(_rollout_metrics(log_ratio, uncorrected, inputs.loss_mask))
    return loss, metrics


@register_loss("dppo_tv")
def dppo_total_variation(inputs: LossInputs, config: AlgorithmConfig) -> LossResult:
    """DPPO-Binary-TV (arXiv 2602.04879) anchored to π_behav: per token −κ·A·ρ, ρ = π_θ/π_behav, whose gradient
    is −κ·ρ·A·∇log π_θ. D = π_θ − π_behav is the token's probability shift (|D| is the total variation between
    "this token or another" under the two policies); κ = 0 where |D| > dppo_tv_bound and A·D > 0, i.e. the
    advantage pushes the token further out of the region, else 1. ρ is neither clipped nor truncated: the mask
    is the only bound, so a rare token's ratio may grow large while its probability moves little."""
    shift = _probability_shift(inputs)  # [B, T]
    return _divergence_masked(inputs, config, shift.abs(), config.dppo_tv_bound, shift)


@register_loss("dppo_kl")
def dppo_binary_kl(inputs: LossInputs, config: AlgorithmConfig) -> LossResult:
    """DPPO-Binary-KL (arXiv 2602.04879) anchored to π_behav: as dppo_tv, with κ = 0 where
    KL(Bern(π_behav)‖Bern(π_θ)) (loss_terms.binary_kl) exceeds dppo_kl_bound and A·(π_θ − π_behav) > 0."""
    divergence = binary_kl(inputs.behaviour_logprobs, inputs.logprobs.detach())  # [B, T]
    return _divergence_masked(inputs, config, divergence, config.dppo_kl_bound, _probability_shift(inputs))


@register_loss("m2po")
def second_moment_masked(inputs: LossInputs, config: AlgorithmConfig) -> LossResult:
    """M2PO (arXiv 2510.01161): per token −κ·A·ρ, ρ = π_θ/π_behav, no clip. With s = (log π_prox − log π_behav)²,
    κ = 0 on the trained tokens whose s exceeds the cutoff c of loss_terms.second_moment_cutoff: the largest
    s are masked, as few as it takes for the mean s of the kept tokens to be at most m2_threshold. s uses π_prox,
    fixed for the batch (as AReaL computes it); with one optimizer step per batch π_prox is π_θ, the paper's
    form. c is taken over the whole optimizer step when the learner passes `m2_cutoff`, else over these tokens."""
    proximal = _required(inputs.proximal_logprobs, "proximal_logprobs", "loss 'm2po'")  # [B, T]
    log_ratio = proximal - inputs.behaviour_logprobs  # [B, T]
    squared = log_ratio.detach().square()  # [B, T]
    trained = inputs.loss_mask.bool()  # [B, T]
    cutoff = inputs.m2_cutoff if inputs.m2_cutoff is not None else second_moment_cutoff(squared[trained], config.m2_threshold)
    masked = trained & (squared > cutoff)  # [B, T]
    loss, metrics = _masked_importance_loss(inputs, config, masked)
    metrics.update(second_moment_summary(squared[trained], cutoff))
    metrics.update(_rollout_metrics(log_ratio, _masked_weight(log_ratio, masked), inputs.loss_mask))
    return loss, metrics


@register_loss("decoupled_ppo_kl")
def decoupled_ppo_behaviour_kl(inputs: LossInputs, config: AlgorithmConfig) -> LossResult:
    """decoupled_ppo + behaviour_kl_coef · KL(π_behav‖π_θ), the KL estimated per token by k3 on the tokens
    π_behav sampled: (ρ − 1) − log ρ with ρ = π_θ/π_behav (unbiased for KL(π_behav‖π_θ) under π_behav's samples;
    to second order in log ρ it equals KL(π_θ‖π_behav)), aggregated like the policy loss. Its gradient
    (ρ − 1)·∇log π_θ pulls every token's probability back toward π_behav's, however many steps π_θ took."""
    loss, metrics = decoupled_ppo(inputs, config)
    per_token = k3_from_log_ratio(inputs.logprobs - inputs.behaviour_logprobs)  # [B, T]
    kl_loss = aggregate(per_token, inputs.loss_mask, config.aggregation, inputs.denominator)  # []
    metrics["actor/behaviour_kl_loss"] = kl_loss.item()
    metrics["actor/behaviour_kl_coef"] = config.behaviour_kl_coef
    return loss + config.behaviour_kl_coef * kl_loss, metrics


def second_moment_summary(squared: Tensor, cutoff: float) -> Metrics:
    """M2PO's statistic over [N] squared log ratios: its mean over every token (`trust_region/m2`) and over the
    tokens the cutoff keeps (`trust_region/m2_kept`, at most m2_threshold); 0 for an empty set. The learner
    reports them over the whole optimizer step, where the loss alone sees one micro-batch."""
    kept = squared[squared <= cutoff]  # [n]
    return {"trust_region/m2": squared.mean().item() if squared.numel() else 0.0,
            "trust_region/m2_kept": kept.mean().item() if kept.numel() else 0.0}


def sequences_within_ratio_bounds(log_ratio: Tensor, mask: Tensor, config: AlgorithmConfig) -> Tensor:
    """[B] bool: the sequence's IS ratio lies in [seq_mask_low, seq_mask_high].

    geometric_mean: exp(mean of the masked tokens' log ratios) must lie in the bounds;
    worst_token: every masked token's ratio must. A sequence without masked tokens is kept (it adds nothing).
    """
    low, high = config.seq_mask_low, config.seq_mask_high
    if config.seq_mask_statistic == GEOMETRIC_MEAN:
        mean_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask_count(mask, dim=-1).clamp(min=1)  # [B]
        sequence_ratio = ratio_from_log(mean_log_ratio)  # [B]
        return (sequence_ratio >= low) & (sequence_ratio <= high)
    if config.seq_mask_statistic == WORST_TOKEN:
        token_ratio = ratio_from_log(log_ratio)  # [B, T]
        out_of_bounds = mask.bool() & ((token_ratio < low) | (token_ratio > high))  # [B, T]
        return ~out_of_bounds.any(dim=-1)
    statistic = config.seq_mask_statistic
    raise ValueError(f"algorithm.seq_mask_statistic: '{statistic}' is not one of {list(SEQ_MASK_STATISTICS)}")


def _weighted_ppo(
    inputs: LossInputs, config: AlgorithmConfig, anchor: Tensor, weight: Tensor, mask: Tensor
) -> LossResult:
    """Aggregate of weight · ℓ_clip(π_θ/π_anchor) over `mask`, with the actor metrics."""
    surrogate = clipped_surrogate(inputs.logprobs, anchor, inputs.advantages, config.clip_eps_low, config.clip_eps_high)
    loss = aggregate(weight * surrogate.loss, mask, config.aggregation, inputs.denominator)  # []
    metrics = {
        "actor/pg_loss": loss.item(),
        "actor/pg_clipfrac": masked_mean(surrogate.clipped.float(), mask).item(),
        "actor/ppo_kl": _mean_log_ratio(inputs, anchor, mask),
    }
    return loss, metrics


def _probability_shift(inputs: LossInputs) -> Tensor:
    """[B, T] π_θ − π_behav per token, in probability, detached (it decides a mask, never a gradient)."""
    return ratio_from_log(inputs.logprobs.detach()) - ratio_from_log(inputs.behaviour_logprobs)


def _divergence_masked(
    inputs: LossInputs, config: AlgorithmConfig, divergence: Tensor, bound: float, shift: Tensor
) -> LossResult:
    """DPPO: −κ·A·ρ with the tokens that leave the trust region (loss_terms.leaves_trust_region) masked."""
    masked = inputs.loss_mask.bool() & leaves_trust_region(divergence, bound, shift, inputs.advantages)  # [B, T]
    loss, metrics = _masked_importance_loss(inputs, config, masked)
    metrics["trust_region/divergence_mean"] = masked_mean(divergence.detach(), inputs.loss_mask).item()
    log_ratio = inputs.logprobs - inputs.behaviour_logprobs  # [B, T]
    metrics.update(_rollout_metrics(log_ratio, _masked_weight(log_ratio, masked), inputs.loss_mask))
    return loss, metrics


def _masked_importance_loss(inputs: LossInputs, config: AlgorithmConfig, masked: Tensor) -> LossResult:
    """Aggregate over the trained tokens of −A·ρ, ρ = π_θ/π_behav (gradient −ρ·A·∇log π_θ), with 0 on the masked
    tokens, which stay in the aggregation's count as PPO's clipped tokens do. Masked tokens are this loss's
    clip: `actor/pg_clipfrac` and `trust_region/masked_frac` are their share."""
    ratio = ratio_from_log(inputs.logprobs - inputs.behaviour_logprobs)  # [B, T]
    per_token = torch.where(masked, torch.zeros_like(ratio), -inputs.advantages * ratio)  # [B, T]
    loss = aggregate(per_token, inputs.loss_mask, config.aggregation, inputs.denominator)  # []
    masked_share = masked_mean(masked.float(), inputs.loss_mask).item()
    metrics = {
        "actor/pg_loss": loss.item(),
        "actor/pg_clipfrac": masked_share,
        "actor/ppo_kl": _mean_log_ratio(inputs, inputs.behaviour_logprobs, inputs.loss_mask),
        "trust_region/masked_frac": masked_share,
    }
    return loss, metrics


def _masked_weight(log_ratio: Tensor, masked: Tensor) -> Correction:
    """The weight a masking loss applies: the IS ratio exp(log_ratio), 0 where masked."""
    ratio = ratio_from_log(log_ratio.detach())  # [B, T]
    return Correction(weight=torch.where(masked, torch.zeros_like(ratio), ratio), changed=masked)


def _rollout_metrics(log_ratio: Tensor, correction: Correction, mask: Tensor) -> Metrics:
    """`rollout_corr/*`: how far the sampling policy is from the learner's, and what the correction did.

    log_ratio = log π_learner - log π_behav, π_learner = π_prox where the mode has it, else π_θ;
    is_weight_mean: mean of the per-token weight the loss applies (1 when it applies none);
    is_clip_frac: share of trained tokens the correction changed (truncated at C, or dropped);
    mismatch_kl: k3 estimate of KL(π_behav‖π_learner).
    """
    log_ratio = log_ratio.detach()  # [B, T]
    return {
        "rollout_corr/is_weight_mean": masked_mean(correction.weight, mask).item(),
        "rollout_corr/is_clip_frac": masked_mean(correction.changed.float(), mask).item(),
        "rollout_corr/mismatch_kl": masked_mean(k3_from_log_ratio(log_ratio), mask).item(),
    }


def _mean_log_ratio(inputs: LossInputs, anchor: Tensor, mask: Tensor) -> float:
    """verl's `actor/ppo_kl`: mean of log π_anchor - log π_θ over the trained tokens."""
    return masked_mean(anchor.detach() - inputs.logprobs.detach(), mask).item()


def _required(tensor: Tensor | None, name: str, needed_by: str) -> Tensor:
    if tensor is None:
        raise ValueError(f"{needed_by} needs LossInputs.{name}, which is None")
    return tensor
