"""Policy losses against values worked out by hand, for every mode: clip boundaries, clip-higher, IS cap,
sequence masking, aggregation, KL estimators, entropy, masks, gradients, and the loss registry."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest
import torch

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.fields import CHOICES_KEY
from learner.maths.advantages import get_advantage
from learner.maths.loss_terms import AGGREGATIONS, KL_ESTIMATORS, clipped_surrogate, token_entropy
from learner.maths.losses import (
    LOSSES,
    SEQ_MASK_STATISTICS,
    LossInputs,
    compute_policy_loss,
    get_loss,
    naive_ppo,
    register_loss,
)
from learner.maths.registry import RegistryError
from tests.fixture_files import CUSTOM_LOSSES

MODES = ("decoupled_ppo", "tis", "seq_mask", "naive_ppo", "dppo_tv", "dppo_kl", "m2po", "decoupled_ppo_kl")
TOLERANCE = 1e-5  # float32 arithmetic on values of order 1


def logs(*rows: list[float]) -> torch.Tensor:
    """Log-probabilities from probabilities, one list per sequence: [B, T]."""
    return torch.tensor(rows).log()


def values(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def trainable(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone().requires_grad_(True)


def assert_metrics(metrics: dict[str, float], expected: dict[str, float]) -> None:
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=TOLERANCE), name


# -------------------------------------------------------------------------------------------- clip


def test_clip_boundaries_per_token():
    # ε = 0.25 both sides: bounds 0.75 and 1.25 are exact in float32, as are these ratios' round trips.
    # ℓ = max(-A·r, -A·clip(r, 0.75, 1.25)); clipped = the clipped branch is strictly larger.
    ratios = [0.74, 0.75, 0.76, 1.24, 1.25, 1.26]
    logprobs = values(ratios).log()  # anchor log-prob 0, so r = exp(log r)
    anchor = torch.zeros_like(logprobs)
    # A = +1: ℓ = max(-r, -clip(r)); only r = 1.26 > 1.25 is clipped (-1.25 > -1.26); at 1.25 both are equal
    positive = clipped_surrogate(logprobs, anchor, torch.ones_like(logprobs), 0.25, 0.25)
    assert positive.loss.tolist()[0] == pytest.approx([-0.74, -0.75, -0.76, -1.24, -1.25, -1.25])
    assert positive.clipped.tolist()[0] == [False, False, False, False, False, True]
    # A = -1: ℓ = max(r, clip(r)); only r = 0.74 < 0.75 is clipped (0.75 > 0.74); at 0.75 both are equal
    negative = clipped_surrogate(logprobs, anchor, -torch.ones_like(logprobs), 0.25, 0.25)
    assert negative.loss.tolist()[0] == pytest.approx([0.75, 0.75, 0.76, 1.24, 1.25, 1.26])
    assert negative.clipped.tolist()[0] == [True, False, False, False, False, False]


def test_clip_boundaries_through_naive_ppo_loss_metrics_and_gradient():
    # the same six ratios with A = +1, against π_behav (naive_ppo), token_mean over 6 tokens:
    # loss = (-0.74 - 0.75 - 0.76 - 1.24 - 1.25 - 1.25) / 6 = -5.99 / 6
    # ∂loss/∂log π_θ = -A·r/6 where unclipped (∂r/∂log π_θ = r), 0 where clipped
    ratios = [0.74, 0.75, 0.76, 1.24, 1.25, 1.26]
    logprobs = trainable(values(ratios).log())
    inputs = LossInputs(logprobs, torch.zeros(1, 6), torch.ones(1, 6), torch.ones(1, 6))
    loss, metrics = naive_ppo(inputs, AlgorithmConfig(clip_eps_low=0.25, clip_eps_high=0.25))
    assert loss.item() == pytest.approx(-5.99 / 6)
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-r / 6 for r in ratios[:5]] + [0.0])
    # ppo_kl = mean(log π_behav - log π_θ) = -mean(log r)
    expected_kl = -sum(math.log(r) for r in ratios) / 6
    assert_metrics(metrics, {"actor/pg_loss": -5.99 / 6, "actor/pg_clipfrac": 1 / 6, "actor/ppo_kl": expected_kl})


def test_clip_higher_is_asymmetric():
    # ε_low = 0.2, ε_high = 0.28: bounds [0.8, 1.28]
    # r = 1.25, A = +1: inside 1.28, unclipped: ℓ = -1.25 (a symmetric ε = 0.2 would clip it to -1.2)
    # r = 0.75, A = -1: below 0.8, clipped: ℓ = max(0.75, 0.8) = 0.8
    logprobs = values([1.25, 0.75]).log()
    advantages = values([1.0, -1.0])
    asymmetric = clipped_surrogate(logprobs, torch.zeros(1, 2), advantages, 0.2, 0.28)
    assert asymmetric.loss.tolist()[0] == pytest.approx([-1.25, 0.8])
    assert asymmetric.clipped.tolist()[0] == [False, True]
    symmetric = clipped_surrogate(logprobs, torch.zeros(1, 2), advantages, 0.2, 0.2)
    assert symmetric.loss.tolist()[0] == pytest.approx([-1.2, 0.8])
    assert symmetric.clipped.tolist()[0] == [True, True]


# ----------------------------------------------------------------------------------- decoupled PPO


def decoupled_batch() -> LossInputs:
    # ρ = π_prox/π_behav = [0.6/0.4, 0.6/0.2, 0.5/0.5] = [1.5, 3, 1] → w = min(ρ, 2) = [1.5, 2, 1]
    # r = π_θ/π_prox = [0.6/0.6, 0.9/0.6, 0.45/0.5] = [1, 1.5, 0.9];  A = [1, 1, -1];  ε = 0.2
    return LossInputs(
        logprobs=trainable(logs([0.6, 0.9, 0.45])),
        behaviour_logprobs=trainable(logs([0.4, 0.2, 0.5])),
        advantages=values([1.0, 1.0, -1.0]),
        loss_mask=torch.ones(1, 3),
        proximal_logprobs=trainable(logs([0.6, 0.6, 0.5])),
    )


def test_decoupled_ppo_values_and_metrics():
    # t1: w=1.5, ℓ = max(-1, -1) = -1            → -1.5
    # t2: w=2 (capped), ℓ = max(-1.5, -1.2) = -1.2 (clipped) → -2.4
    # t3: w=1, ℓ = max(0.9, 0.9) = 0.9             → 0.9
    # token_mean = (-1.5 - 2.4 + 0.9) / 3 = -1.0
    loss, metrics = compute_policy_loss(decoupled_batch(), AlgorithmConfig(loss="decoupled_ppo", is_cap=2.0))
    assert loss.item() == pytest.approx(-1.0)
    # ppo_kl = mean(log π_prox - log π_θ) = (0 + log(0.6/0.9) + log(0.5/0.45)) / 3
    # is_weight_mean = (1.5 + 2 + 1) / 3; is_clip_frac = 1/3 (t2)
    # mismatch_kl = mean((ρ-1) - log ρ) = ((0.5 - log 1.5) + (2 - log 3) + 0) / 3
    assert_metrics(
        metrics,
        {
            "actor/pg_loss": -1.0,
            "actor/pg_clipfrac": 1 / 3,
            "actor/ppo_kl": (math.log(0.6 / 0.9) + math.log(0.5 / 0.45)) / 3,
            "rollout_corr/is_weight_mean": 1.5,
            "rollout_corr/is_clip_frac": 1 / 3,
            "rollout_corr/mismatch_kl": ((0.5 - math.log(1.5)) + (2 - math.log(3))) / 3,
        },
    )


def test_decoupled_ppo_weight_carries_no_gradient():
    # ∂loss/∂log π_θ = -A·w·r/3 where unclipped:
    #   t1 = -1·1.5·1/3 = -0.5;  t2 clipped = 0;  t3 = +1·1·0.9/3 = 0.3
    # w depends on π_prox and π_behav only through sg(·), and the clip anchor π_prox is detached too
    inputs = decoupled_batch()
    loss, _ = compute_policy_loss(inputs, AlgorithmConfig(loss="decoupled_ppo", is_cap=2.0))
    loss.backward()
    assert inputs.logprobs.grad.tolist()[0] == pytest.approx([-0.5, 0.0, 0.3])
    assert inputs.proximal_logprobs.grad is None
    assert inputs.behaviour_logprobs.grad is None


def test_is_cap_truncates_the_weight():
    # raising C from 2 to 4 lets t2 keep its full weight ρ = 3: (-1.5 - 3·1.2 + 0.9) / 3 = -1.4
    loss, metrics = compute_policy_loss(decoupled_batch(), AlgorithmConfig(loss="decoupled_ppo", is_cap=4.0))
    assert loss.item() == pytest.approx(-1.4)
    assert_metrics(metrics, {"rollout_corr/is_weight_mean": 5.5 / 3, "rollout_corr/is_clip_frac": 0.0})


def test_on_policy_decoupled_ppo_and_seq_mask_equal_naive_ppo():
    # with π_prox = π_behav (K = 0, nothing stale) every IS weight is 1 and no sequence is dropped
    inputs = replace(decoupled_batch(), behaviour_logprobs=logs([0.6, 0.6, 0.5]))
    naive, _ = compute_policy_loss(inputs, AlgorithmConfig(loss="naive_ppo"))
    for mode in ("decoupled_ppo", "seq_mask"):
        loss, metrics = compute_policy_loss(inputs, AlgorithmConfig(loss=mode))
        assert loss.item() == pytest.approx(naive.item())
        assert_metrics(metrics, {"rollout_corr/is_weight_mean": 1.0, "rollout_corr/mismatch_kl": 0.0})


@pytest.mark.parametrize("mode", ["decoupled_ppo", "seq_mask"])
def test_modes_with_a_proximal_pass_need_proximal_logprobs(mode):
    inputs = replace(decoupled_batch(), proximal_logprobs=None)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        compute_policy_loss(inputs, AlgorithmConfig(loss=mode))


# --------------------------------------------------------------------------------------------- TIS


def test_tis_values_gradient_and_metrics():
    # ρ = π_θ/π_behav = [0.5/0.5, 0.6/0.2, 0.25/0.5] = [1, 3, 0.5] → w = min(ρ, 2) = [1, 2, 0.5];  A = [1, 2, -1]
    # ℓ = -w·A·log π_θ: t1 = -1·1·log 0.5; t2 = -2·2·log 0.6; t3 = -0.5·(-1)·log 0.25 = -(t1)
    # token_mean = (-4·log 0.6) / 3;  ∂/∂log π_θ = -w·A/3 = [-1/3, -4/3, 0.5/3]  (w has no gradient)
    logprobs = trainable(logs([0.5, 0.6, 0.25]))
    behaviour = trainable(logs([0.5, 0.2, 0.5]))
    inputs = LossInputs(logprobs, behaviour, values([1.0, 2.0, -1.0]), torch.ones(1, 3))
    loss, metrics = compute_policy_loss(inputs, AlgorithmConfig(loss="tis", is_cap=2.0))
    assert loss.item() == pytest.approx(-4 * math.log(0.6) / 3)
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-1 / 3, -4 / 3, 0.5 / 3])
    assert behaviour.grad is None
    assert_metrics(
        metrics,
        {
            "actor/pg_clipfrac": 1 / 3,  # truncation is tis's only clip
            "actor/ppo_kl": (0 + math.log(0.2 / 0.6) + math.log(0.5 / 0.25)) / 3,
            "rollout_corr/is_weight_mean": 3.5 / 3,
            "rollout_corr/is_clip_frac": 1 / 3,
            "rollout_corr/mismatch_kl": ((2 - math.log(3)) + (-0.5 - math.log(0.5))) / 3,
        },
    )


# -------------------------------------------------------------------------------- sequence masking


def seq_mask_batch() -> LossInputs:
    # π_θ = π_prox (r = 1, ℓ = -A); ρ = π_prox/π_behav per token, π_behav = 0.1 everywhere:
    #   seq 1: ρ = [4, 0.5]          geometric mean √2 ∈ [0.5, 2] (kept);  worst token 4 > 2 (dropped)
    #   seq 2: ρ = [3, 3]            geometric mean 3 > 2, dropped by both
    #   seq 3: ρ = [1, 9 (masked)]   kept by both: the masked token is not looked at
    proximal = logs([0.4, 0.05], [0.3, 0.3], [0.1, 0.9])
    return LossInputs(
        logprobs=trainable(proximal),
        behaviour_logprobs=torch.full((3, 2), 0.1).log(),
        advantages=values([1.0, 1.0], [5.0, 5.0], [2.0, 0.0]),
        loss_mask=values([1, 1], [1, 1], [1, 0]),
        proximal_logprobs=proximal,
    )


@pytest.mark.parametrize(
    "statistic, expected_loss, dropped_tokens",
    [
        ("geometric_mean", (-1 - 1 - 2) / 3, 2),  # seqs 1 and 3 kept: 3 tokens
        ("worst_token", -2 / 1, 4),  # seq 3 only
    ],
)
def test_seq_mask_drops_whole_sequences(statistic, expected_loss, dropped_tokens):
    config = AlgorithmConfig(loss="seq_mask", seq_mask_low=0.5, seq_mask_high=2.0, seq_mask_statistic=statistic)
    loss, metrics = compute_policy_loss(seq_mask_batch(), config)
    assert loss.item() == pytest.approx(expected_loss)
    # 5 trained tokens; is_weight_mean = kept share, is_clip_frac = dropped share
    assert_metrics(
        metrics,
        {"rollout_corr/is_clip_frac": dropped_tokens / 5, "rollout_corr/is_weight_mean": 1 - dropped_tokens / 5},
    )


def test_seq_mask_dropping_everything_gives_zero_loss_and_gradient():
    inputs = seq_mask_batch()
    config = AlgorithmConfig(loss="seq_mask", seq_mask_low=1.0, seq_mask_high=1.0, seq_mask_statistic="worst_token")
    inputs = replace(inputs, proximal_logprobs=inputs.behaviour_logprobs + 0.5)  # every ρ = e^0.5 > 1
    loss, metrics = compute_policy_loss(inputs, config)
    loss.backward()
    assert loss.item() == 0.0
    assert inputs.logprobs.grad.abs().sum().item() == 0.0
    assert metrics["rollout_corr/is_clip_frac"] == 1.0


# ------------------------------------------------------------------- naive PPO, aggregation, masks


def ragged_batch() -> LossInputs:
    # π_θ = π_behav, so every mode's ℓ is -A (r = 1, ρ = 1): seq 1 has 3 trained tokens with A = 1,
    # seq 2 one trained token with A = 4 then padding, seq 3 is all padding
    behaviour = logs([0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    return LossInputs(
        logprobs=trainable(behaviour),
        behaviour_logprobs=behaviour,
        advantages=values([1.0, 1.0, 1.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]),
        loss_mask=values([1, 1, 1], [1, 0, 0], [0, 0, 0]),
        proximal_logprobs=behaviour,
    )


@pytest.mark.parametrize("mode", ["decoupled_ppo", "seq_mask", "naive_ppo"])
def test_aggregation_modes_differ_on_ragged_masks(mode):
    # token_mean = -(1 + 1 + 1 + 4) / 4 tokens = -1.75
    # seq_mean_token_sum = -((1 + 1 + 1) + 4) / 2 sequences with trained tokens = -3.5 (the padding row is not counted)
    # seq_mean_token_sum_norm = -7 / (2 sequences × 3, the most trained tokens standing for L without one) = -7/6
    losses = [compute_policy_loss(ragged_batch(), AlgorithmConfig(loss=mode, aggregation=aggregation))[0].item()
              for aggregation in ("token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")]
    assert losses == pytest.approx([-1.75, -3.5, -7 / 6])


def test_tis_aggregation_modes_differ_on_ragged_masks():
    # ℓ = -1·A·log 0.5 = A·log 2: token_mean = 7·log 2 / 4, seq_mean_token_sum = 7·log 2 / 2
    token_mean, _ = compute_policy_loss(ragged_batch(), AlgorithmConfig(loss="tis", aggregation="token_mean"))
    seq_mean, _ = compute_policy_loss(ragged_batch(), AlgorithmConfig(loss="tis", aggregation="seq_mean_token_sum"))
    assert (token_mean.item(), seq_mean.item()) == pytest.approx((7 * math.log(2) / 4, 7 * math.log(2) / 2))


@pytest.mark.parametrize(
    "aggregation, denominator, expected",
    [("token_mean", 8.0, -7 / 8), ("seq_mean_token_sum", 4.0, -7 / 4),  # Σ = -7 over the denominator
     ("seq_mean_token_sum_norm", 4.0 * 512, -7 / 2048)],  # 4 sequences × L = 512
)
def test_denominator_of_the_whole_batch_replaces_the_micro_batch_count(aggregation, denominator, expected):
    inputs = replace(ragged_batch(), denominator=denominator)
    loss, _ = compute_policy_loss(inputs, AlgorithmConfig(loss="naive_ppo", aggregation=aggregation))
    assert loss.item() == pytest.approx(expected)


def with_masked_token(tensor: torch.Tensor, value: float) -> torch.Tensor:
    """[1, T] → [1, T + 1]: one more token holding `value`."""
    return torch.cat([tensor.detach(), torch.full((1, 1), value)], dim=1)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("mode", MODES)
def test_masked_tokens_change_nothing(mode, aggregation):
    # one more token, masked out, with wild values everywhere: loss, metrics and gradients stay the same
    base = decoupled_batch()
    base = LossInputs(
        logprobs=base.logprobs.detach(),
        behaviour_logprobs=base.behaviour_logprobs.detach(),
        advantages=base.advantages,
        loss_mask=base.loss_mask,
        proximal_logprobs=base.proximal_logprobs.detach(),
        reference_logprobs=base.logprobs.detach() - 0.1,
        entropy=torch.ones(1, 3),
    )
    padded = LossInputs(
        logprobs=with_masked_token(base.logprobs, 30.0),
        behaviour_logprobs=with_masked_token(base.behaviour_logprobs, -40.0),
        advantages=with_masked_token(base.advantages, 1e6),
        loss_mask=with_masked_token(base.loss_mask, 0.0),
        proximal_logprobs=with_masked_token(base.proximal_logprobs, 25.0),
        reference_logprobs=with_masked_token(base.reference_logprobs, -30.0),
        entropy=with_masked_token(base.entropy, 1e9),
    )
    config = AlgorithmConfig(loss=mode, aggregation=aggregation, use_reference=True, kl_coef=0.5)
    results = []
    for inputs in (base, padded):
        inputs.logprobs.requires_grad_(True)
        loss, metrics = compute_policy_loss(inputs, config)
        loss.backward()
        results.append((loss.item(), metrics, inputs.logprobs.grad[0, :3].tolist()))
    (loss_base, metrics_base, grad_base), (loss_padded, metrics_padded, grad_padded) = results
    assert loss_padded == pytest.approx(loss_base)
    assert metrics_padded == pytest.approx(metrics_base)
    assert grad_padded == pytest.approx(grad_base)
    assert padded.logprobs.grad[0, 3].item() == 0.0


# ---------------------------------------------------------------------------------- KL and entropy


def kl_batch() -> LossInputs:
    # A = 0 and π_θ = π_behav, so the policy term is 0 and the loss is kl_coef · KL
    # π_θ = [0.5, 0.25], π_ref = [0.25, 0.5]
    policy = logs([0.5, 0.25])
    return LossInputs(
        logprobs=trainable(policy),
        behaviour_logprobs=policy,
        advantages=torch.zeros(1, 2),
        loss_mask=torch.ones(1, 2),
        reference_logprobs=logs([0.25, 0.5]),
    )


def test_kl_k1():
    # k1 = log π_θ - log π_ref = [log 2, -log 2] → mean 0;  ∂/∂log π_θ = kl_coef · 1/2 per token
    inputs = kl_batch()
    config = AlgorithmConfig(loss="naive_ppo", use_reference=True, kl_coef=0.1, kl_estimator="k1")
    loss, metrics = compute_policy_loss(inputs, config)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=TOLERANCE)
    assert inputs.logprobs.grad.tolist()[0] == pytest.approx([0.05, 0.05])
    assert_metrics(metrics, {"actor/kl_loss": 0.0, "actor/kl_coef": 0.1})


def test_kl_k3():
    # r = π_ref/π_θ = [0.5, 2];  k3 = (r - 1) - log r = [-0.5 + log 2, 1 - log 2] → mean 0.25
    # ∂k3/∂log π_θ = 1 - r = [0.5, -1];  ∂loss/∂log π_θ = 0.1 · [0.5, -1] / 2 = [0.025, -0.05]
    inputs = kl_batch()
    config = AlgorithmConfig(loss="naive_ppo", use_reference=True, kl_coef=0.1, kl_estimator="k3")
    loss, metrics = compute_policy_loss(inputs, config)
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * 0.25)
    assert inputs.logprobs.grad.tolist()[0] == pytest.approx([0.025, -0.05])
    assert_metrics(metrics, {"actor/kl_loss": 0.25})


def test_kl_is_off_without_use_reference_and_needs_reference_logprobs_with_it():
    _, metrics = compute_policy_loss(kl_batch(), AlgorithmConfig(loss="naive_ppo"))
    assert "actor/kl_loss" not in metrics
    inputs = replace(kl_batch(), reference_logprobs=None)
    with pytest.raises(ValueError, match="reference_logprobs"):
        compute_policy_loss(inputs, AlgorithmConfig(loss="naive_ppo", use_reference=True))


def test_token_entropy_and_entropy_metric():
    # p = [0.5, 0.25, 0.25]: H = 0.5·log 2 + 2·0.25·log 4 = 1.5·log 2;  uniform over 4: H = log 4
    logits = torch.stack([logs([0.5, 0.25, 0.25]), torch.zeros(1, 3)], dim=1)  # [1, 2, 3]
    uniform_over_four = torch.zeros(1, 1, 4)  # [1, 1, 4]
    assert token_entropy(logits).tolist()[0] == pytest.approx([1.5 * math.log(2), math.log(3)])
    assert token_entropy(uniform_over_four).item() == pytest.approx(math.log(4))
    # the metric averages the 4 trained tokens of the ragged batch only: (1 + 2 + 3 + 6) / 4 = 3
    inputs = replace(ragged_batch(), entropy=values([1.0, 2.0, 3.0], [6.0, 99.0, 99.0], [99.0, 99.0, 99.0]))
    _, metrics = compute_policy_loss(inputs, AlgorithmConfig(loss="naive_ppo"))
    assert metrics["actor/entropy"] == pytest.approx(3.0)


# ---------------------------------------------------------------------------------------- registry


def test_every_mode_is_registered_and_reports_the_verl_metrics():
    assert set(MODES) <= set(LOSSES.names())
    expected = {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "rollout_corr/is_weight_mean",
        "rollout_corr/is_clip_frac",
        "rollout_corr/mismatch_kl",
    }
    for mode in MODES:
        _, metrics = compute_policy_loss(decoupled_batch(), AlgorithmConfig(loss=mode))
        assert expected <= set(metrics), mode
        assert all(isinstance(value, float) for value in metrics.values())


def test_loss_from_a_user_file_and_from_a_module_path():
    # sign_only_loss = -Σ sign(A)·log π_θ = -(log 0.6 + log 0.9 - log 0.45)
    loss, metrics = compute_policy_loss(decoupled_batch(), AlgorithmConfig(loss=f"{CUSTOM_LOSSES}:sign_only_loss"))
    assert loss.item() == pytest.approx(-(math.log(0.6) + math.log(0.9) - math.log(0.45)))
    assert metrics["actor/pg_loss"] == pytest.approx(loss.item())
    assert get_loss("learner.maths.losses:naive_ppo") is naive_ppo
    assert get_loss(f"{CUSTOM_LOSSES}:sign_only_loss") is get_loss(f"{CUSTOM_LOSSES}:sign_only_loss")  # imported once


def test_register_loss_adds_a_name_and_refuses_a_second_function_under_it():
    @register_loss("test_only_zero_loss")
    def zero_loss(inputs, config):
        return inputs.logprobs.sum() * 0, {}

    assert get_loss("test_only_zero_loss") is zero_loss
    with pytest.raises(RegistryError, match="already registered"):
        register_loss("test_only_zero_loss")(naive_ppo)


@pytest.mark.parametrize(
    "value, message",
    [
        ("ppo_decoupled", r"algorithm.loss: loss 'ppo_decoupled': no such loss \(registered: .*decoupled_ppo"),
        ("missing_file.py:loss", r"algorithm.loss: .*file '.*missing_file.py' does not exist"),
        (f"{CUSTOM_LOSSES}:no_such_loss", r"defines no 'no_such_loss' \(functions there: constant_advantage, sign_only"),
        (f"{CUSTOM_LOSSES}:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' .* is a int, not a function"),
        ("asyncrl.no_such_module:loss", r"importing module 'asyncrl.no_such_module' failed: ModuleNotFoundError"),
        ("learner.maths.losses:", r"expected 'path/to/file.py:function'"),
    ],
)
def test_unresolvable_losses_are_named_in_the_error(value, message):
    with pytest.raises(RegistryError, match=message):
        get_loss(value)


def test_a_broken_user_file_reports_its_own_error(tmp_path):
    broken = tmp_path / "broken_loss.py"
    broken.write_text("raise RuntimeError('half-written loss')\n")
    with pytest.raises(RegistryError, match="importing .*broken_loss.py' failed: RuntimeError: half-written loss"):
        get_loss(f"{broken}:loss")


def test_config_choices_are_exactly_what_the_learner_accepts():
    choices = {spec.name: spec.metadata.get(CHOICES_KEY) for spec in dataclasses.fields(AlgorithmConfig)}
    assert set(choices["aggregation"]) == set(AGGREGATIONS)
    assert set(choices["kl_estimator"]) == set(KL_ESTIMATORS)
    assert set(choices["seq_mask_statistic"]) == set(SEQ_MASK_STATISTICS)
    get_loss(AlgorithmConfig().loss)
    get_advantage(AlgorithmConfig().advantage)
