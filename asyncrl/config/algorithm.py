"""The `algorithm` section: which policy loss and advantage estimator the learner uses, and their knobs.

`loss` and `advantage` take a registered name or `path/to/file.py:function` / `package.module:function`
(a user's own function), so they are plain strings; the learner resolves them at startup and names the
key when one cannot be found. docs/losses.md gives the formula behind every field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from asyncrl.config.fields import bounded, one_of
from asyncrl.staleness import TOKEN_BOUND_OFF
from asyncrl.wire_limits import MAX_VERSION


@dataclass
class AlgorithmConfig:
    loss: str = "decoupled_ppo_kl"  # policy loss: decoupled_ppo_kl, decoupled_ppo, tis, seq_mask, naive_ppo, dppo_tv, dppo_kl, m2po, or 'file.py:fn' / 'pkg.mod:fn'
    advantage: str = "grpo"  # advantage estimator: grpo, rloo, reinforce_pp, reinforce_pp_baseline, or 'file.py:fn'
    aggregation: str = one_of("token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")  # how per-token losses become one number (docs/losses.md)
    norm_tokens: int = bounded(0, 0)  # seq_mean_token_sum_norm: L, the constant tokens per sequence it divides by; 0 = rollout.sampling.max_tokens
    clip_eps_low: float = bounded(0.2, 0.0, 1.0)  # PPO clip: the ratio's floor is 1 - clip_eps_low
    clip_eps_high: float = bounded(0.2, 0.0)  # PPO clip: ceiling 1 + clip_eps_high; above clip_eps_low = clip-higher
    is_cap: float = bounded(2.0, 1.0)  # C: importance weights above it are truncated to C (decoupled_ppo, tis)
    seq_mask_low: float = bounded(0.5, 0.0, 1.0)  # seq_mask: sequences whose IS ratio is below this are dropped
    seq_mask_high: float = bounded(2.0, 1.0)  # seq_mask: sequences whose IS ratio is above this are dropped
    seq_mask_statistic: str = one_of("geometric_mean", "worst_token")  # seq_mask: ratio per sequence, or every token's
    dppo_tv_bound: float = bounded(0.15, 0.0, 1.0)  # dppo_tv: δ on |π_θ − π_behav| per token (probability units); tokens past it, moving away, get no gradient
    dppo_kl_bound: float = bounded(0.05, 0.0)  # dppo_kl: δ on the per-token binary KL(π_behav‖π_θ), in nats
    m2_threshold: float = bounded(0.04, 0.0)  # m2po: τ, the bound on the mean of (log π_prox − log π_behav)² over each optimizer step's kept tokens
    behaviour_kl_coef: float = bounded(0.1, 0.0)  # decoupled_ppo_kl: weight of the k3 KL(π_behav‖π_θ) penalty added to decoupled PPO
    mini_batches: int = bounded(1, 1)  # optimizer steps per pass over a batch, each on a share of its groups (a group never splits); 1 = one step per batch
    epochs: int = bounded(1, 1)  # passes over each batch; a batch takes mini_batches × epochs optimizer steps and stays one policy version
    use_reference: bool = False  # add a KL penalty to a frozen reference model (the learner loads it and scores every batch with it)
    reference_path: str = ""  # the reference model's directory; empty = model.path (the policy's starting weights)
    reference_cpu_offload: bool = False  # GPU: keep the reference's weights in CPU memory, copied to the GPU layer by layer for its pass
    kl_coef: float = bounded(0.001, 0.0)  # weight of the KL penalty in the loss (with use_reference)
    kl_estimator: str = one_of("k3", "k1")  # per-token KL estimate: k3 is non-negative and low-variance, k1 unbiased
    grpo_std_norm: bool = True  # GRPO: divide by the group's reward std (False = Dr. GRPO's mean-only baseline)
    adv_eps: float = bounded(1e-6, 0.0)  # added to a std before dividing by it (GRPO std norm, REINFORCE++ whitening)
    max_token_staleness: int = bounded(TOKEN_BOUND_OFF, TOKEN_BOUND_OFF, MAX_VERSION)  # M: tokens sampled more than M versions before the step that trains them are masked out of the loss (counted, the sample kept); -1 = off

    def resolved(self, max_tokens: int) -> AlgorithmConfig:
        """These settings with `norm_tokens` 0 made `max_tokens` (rollout.sampling.max_tokens)."""
        return dataclasses.replace(self, norm_tokens=self.norm_tokens or max_tokens)

    def cross_checks(self, batch_groups: int) -> list[tuple[str, str]]:
        if self.mini_batches > batch_groups:
            return [("algorithm.mini_batches", f"must not exceed buffer.batch_groups={batch_groups}: a mini-batch "
                                               "holds whole groups, at least one")]
        return []
