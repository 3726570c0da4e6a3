"""The behaviour-anchored trust regions against values worked out by hand: DPPO's divergence masks (TV and
binary KL), M2PO's second-moment mask and its cutoff, and decoupled PPO with a KL penalty to π_behav. Each
test names the tokens its mask or penalty must act on, and checks the loss, its gradient and its metrics."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config.algorithm import AlgorithmConfig
from learner.maths.loss_terms import binary_kl, second_moment_cutoff
from learner.maths.losses import LossInputs, compute_policy_loss

TOLERANCE = 1e-5  # float32 arithmetic on values of order 1


def probabilities(*values: float) -> torch.Tensor:
    """One sequence's log-probabilities from probabilities: [1, T]."""
    return torch.tensor([values]).log()


def assert_metrics(metrics: dict[str, float], expected: dict[str, float]) -> None:
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=TOLERANCE), name


def k3(ratio: float) -> float:
    return ratio - 1 - math.log(ratio)


# ------------------------------------------------------------------------------------------------ DPPO

# Seven tokens, one per case of the mask; D = π_θ − π_behav, δ_tv = 0.15, δ_kl = 0.05.
#   token  π_behav  π_θ   A    D      binary KL(π_behav‖π_θ)                      TV mask   KL mask
#   a      0.5      0.7   +1   +0.2   .5·log(.5/.7) + .5·log(.5/.3) = 0.087177     masked    masked   (A pushes up, past δ)
#   b      0.5      0.6   +1   +0.1   .5·log(.5/.6) + .5·log(.5/.4) = 0.020411     kept      kept     (inside)
#   c      0.5      0.3   +1   −0.2   0.087177                                    kept      kept     (A pushes back toward π_behav)
#   d      0.5      0.3   −1   −0.2   0.087177                                    masked    masked   (A pushes down, past δ)
#   e      0.01     0.1   +1   +0.09  .01·log(.01/.1) + .99·log(.99/.9) = 0.071331 kept      masked   (KL past its bound, TV not)
#   f      0.01     0.1   −1   +0.09  0.071331                                    kept      kept     (A pushes back)
#   g      0.5      0.7    0   +0.2   0.087177                                    kept      kept     (no push: A = 0)
BEHAVIOUR = (0.5, 0.5, 0.5, 0.5, 0.01, 0.01, 0.5)
POLICY = (0.7, 0.6, 0.3, 0.3, 0.1, 0.1, 0.7)
ADVANTAGES = (1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 0.0)
RATIOS = [p / b for p, b in zip(POLICY, BEHAVIOUR)]  # ρ = [1.4, 1.2, 0.6, 0.6, 10, 10, 1.4]
BINARY_KL = [0.087177, 0.020411, 0.087177, 0.087177, 0.071331, 0.071331, 0.087177]


def dppo_batch() -> LossInputs:
    return LossInputs(
        logprobs=probabilities(*POLICY).requires_grad_(True),
        behaviour_logprobs=probabilities(*BEHAVIOUR),
        advantages=torch.tensor([ADVANTAGES]),
        loss_mask=torch.ones(1, 7),
    )


def test_binary_kl_per_token():
    assert binary_kl(probabilities(*BEHAVIOUR), probabilities(*POLICY)).tolist()[0] == pytest.approx(BINARY_KL, abs=1e-6)
    # a certain token (probability 1) under both policies: 0, not NaN (log(1 − 1) is floored)
    assert binary_kl(torch.zeros(1, 1), torch.zeros(1, 1)).item() == 0.0


@pytest.mark.parametrize(
    "loss, config, masked, divergence",
    [
        ("dppo_tv", AlgorithmConfig(loss="dppo_tv", dppo_tv_bound=0.15), "ad", [0.2, 0.1, 0.2, 0.2, 0.09, 0.09, 0.2]),
        ("dppo_kl", AlgorithmConfig(loss="dppo_kl", dppo_kl_bound=0.05), "ade", BINARY_KL),
    ],
)
def test_dppo_masks_exactly_the_tokens_that_leave_the_region(loss, config, masked, divergence):
    # per token −κ·A·ρ, token_mean over 7 tokens (masked tokens count, adding 0); ∂/∂log π_θ = −κ·A·ρ/7
    m = [0.0 if name in masked else 1.0 for name in "abcdefg"]
    expected_grad = [-keep * a * r / 7 for keep, a, r in zip(m, ADVANTAGES, RATIOS)]
    # TV: b −1.2, c −0.6, e −10, f +10, g 0 → −1.8/7;   KL: b −1.2, c −0.6, f +10, g 0 → 8.2/7
    expected_loss = sum(expected_grad)
    inputs = dppo_batch()
    total, metrics = compute_policy_loss(inputs, config)
    total.backward()
    assert total.item() == pytest.approx({"dppo_tv": -1.8 / 7, "dppo_kl": 8.2 / 7}[loss], abs=TOLERANCE)
    assert total.item() == pytest.approx(expected_loss, abs=TOLERANCE)
    assert inputs.logprobs.grad.tolist()[0] == pytest.approx(expected_grad, abs=TOLERANCE)
    share = len(masked) / 7
    assert_metrics(metrics, {
        "actor/pg_clipfrac": share,
        "trust_region/masked_frac": share,
        "trust_region/divergence_mean": sum(divergence) / 7,
        "actor/ppo_kl": -sum(math.log(r) for r in RATIOS) / 7,  # mean log π_behav − log π_θ
        "rollout_corr/is_weight_mean": sum(keep * r for keep, r in zip(m, RATIOS)) / 7,
        "rollout_corr/is_clip_frac": share,
        "rollout_corr/mismatch_kl": sum(k3(r) for r in RATIOS) / 7,
    })


def test_dppo_on_policy_masks_nothing_and_is_the_policy_gradient():
    # π_θ = π_behav: D = 0 everywhere, ρ = 1: loss = −mean A, gradient −A/7
    inputs = LossInputs(probabilities(*POLICY).requires_grad_(True), probabilities(*POLICY),
                        torch.tensor([ADVANTAGES]), torch.ones(1, 7))
    loss, metrics = compute_policy_loss(inputs, AlgorithmConfig(loss="dppo_tv"))
    loss.backward()
    assert loss.item() == pytest.approx(-sum(ADVANTAGES) / 7)
    assert inputs.logprobs.grad.tolist()[0] == pytest.approx([-a / 7 for a in ADVANTAGES])
    assert metrics["trust_region/masked_frac"] == 0.0


# ------------------------------------------------------------------------------------------------- M2PO


def test_second_moment_cutoff_keeps_the_smallest_values_under_the_threshold():
    # s sorted: 0.01 0.01 0.04 0.09 0.25; means of the smallest k: 0.01 0.01 0.02 0.0375 0.08
    values = torch.tensor([0.09, 0.01, 0.25, 0.04, 0.01])
    assert second_moment_cutoff(values, 0.04) == pytest.approx(0.09)  # keep 4 (mean 0.0375), mask 0.25
    assert second_moment_cutoff(values, 0.03) == pytest.approx(0.04)  # keep 3 (mean 0.02), mask 0.09 and 0.25
    assert second_moment_cutoff(values, 0.081) == pytest.approx(0.25)  # all five average 0.08: keep all
    assert second_moment_cutoff(torch.tensor([0.25, 0.75]), 0.5) == 0.75  # the bound is inclusive (exact in binary)
    # equal values go together: [0.01, 0.05, 0.05] at τ = 0.035 keeps 0.01 alone (with both 0.05s the mean is
    # 0.0367), although one 0.05 beside it would average 0.03
    assert second_moment_cutoff(torch.tensor([0.05, 0.01, 0.05]), 0.035) == pytest.approx(0.01)
    assert second_moment_cutoff(torch.tensor([0.09, 0.16]), 0.04) == -math.inf  # even the smallest is above τ
    assert second_moment_cutoff(torch.zeros(0), 0.04) == math.inf  # no tokens: nothing to mask


# log π_prox − log π_behav per token: l = [0.1, −0.1, 0.2, 0.3, −0.5] → s = l² = [0.01, 0.01, 0.04, 0.09, 0.25];
# π_θ = π_prox (the one-step form), so ρ = π_θ/π_behav = e^l; A = [1, −1, 1, 1, 1]; a sixth token is masked out
LOG_RATIOS = [0.1, -0.1, 0.2, 0.3, -0.5]
M2_ADVANTAGES = [1.0, -1.0, 1.0, 1.0, 1.0]


def m2po_batch(cutoff: float | None = None) -> LossInputs:
    behaviour = torch.full((1, 6), math.log(0.5))
    proximal = behaviour + torch.tensor([LOG_RATIOS + [3.0]])  # the masked-out token's l = 3 must not count
    return LossInputs(
        logprobs=proximal.clone().requires_grad_(True),
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([M2_ADVANTAGES + [1.0]]),
        loss_mask=torch.tensor([[1.0] * 5 + [0.0]]),
        proximal_logprobs=proximal,
        m2_cutoff=cutoff,
    )


@pytest.mark.parametrize(
    "threshold, cutoff, masked",
    [
        (0.04, None, [4]),  # its own cutoff 0.09: the 0.25 token goes, the kept mean is 0.0375
        (0.03, None, [3, 4]),  # cutoff 0.04: 0.09 and 0.25 go, the kept mean is 0.02
        (0.04, 0.02, [2, 3, 4]),  # the learner's cutoff over the whole step wins over this micro-batch's own
    ],
)
def test_m2po_masks_the_largest_second_moments(threshold, cutoff, masked):
    m = [0.0 if t in masked else 1.0 for t in range(5)]
    ratios = [math.exp(l) for l in LOG_RATIOS]
    expected_grad = [-keep * a * r / 5 for keep, a, r in zip(m, M2_ADVANTAGES, ratios)]  # −κ·A·ρ / 5 tokens
    inputs = m2po_batch(cutoff)
    loss, metrics = compute_policy_loss(inputs, AlgorithmConfig(loss="m2po", m2_threshold=threshold))
    loss.backward()
    assert loss.item() == pytest.approx(sum(expected_grad), abs=TOLERANCE)
    assert inputs.logprobs.grad.tolist()[0] == pytest.approx(expected_grad + [0.0], abs=TOLERANCE)
    squares = [l * l for l in LOG_RATIOS]
    kept = [s for s, keep in zip(squares, m) if keep]
    assert_metrics(metrics, {
        "trust_region/masked_frac": len(masked) / 5,
        "actor/pg_clipfrac": len(masked) / 5,
        "trust_region/m2": sum(squares) / 5,  # 0.072
        "trust_region/m2_kept": sum(kept) / len(kept),
        "rollout_corr/is_weight_mean": sum(keep * r for keep, r in zip(m, ratios)) / 5,
        "rollout_corr/is_clip_frac": len(masked) / 5,
        "rollout_corr/mismatch_kl": sum(k3(r) for r in ratios) / 5,
    })


def test_m2po_needs_proximal_logprobs():
    inputs = m2po_batch()
    inputs.proximal_logprobs = None
    with pytest.raises(ValueError, match="loss 'm2po' needs LossInputs.proximal_logprobs"):
        compute_policy_loss(inputs, AlgorithmConfig(loss="m2po"))


# -------------------------------------------------------------------------- decoupled PPO + KL to π_behav


def test_decoupled_ppo_kl_adds_the_k3_penalty_to_behaviour():
    # test_losses.decoupled_batch: decoupled PPO's loss is −1.0 and its gradient [−0.5, 0, 0.3] (see there).
    # ρ = π_θ/π_behav = [0.6/0.4, 0.9/0.2, 0.45/0.5] = [1.5, 4.5, 0.9]; k3 = (ρ − 1) − log ρ, mean over 3 tokens;
    # ∂k3/∂log π_θ = ρ − 1 = [0.5, 3.5, −0.1]; with β = 0.3: + 0.3·[0.5, 3.5, −0.1]/3 = [0.05, 0.35, −0.01]
    inputs = LossInputs(
        logprobs=probabilities(0.6, 0.9, 0.45).requires_grad_(True),
        behaviour_logprobs=probabilities(0.4, 0.2, 0.5),
        advantages=torch.tensor([[1.0, 1.0, -1.0]]),
        loss_mask=torch.ones(1, 3),
        proximal_logprobs=probabilities(0.6, 0.6, 0.5),
    )
    kl = (k3(1.5) + k3(4.5) + k3(0.9)) / 3
    loss, metrics = compute_policy_loss(inputs, AlgorithmConfig(loss="decoupled_ppo_kl", is_cap=2.0, behaviour_kl_coef=0.3))
    loss.backward()
    assert loss.item() == pytest.approx(-1.0 + 0.3 * kl, abs=TOLERANCE)
    assert inputs.logprobs.grad.tolist()[0] == pytest.approx([-0.45, 0.35, 0.29], abs=TOLERANCE)
    assert_metrics(metrics, {"actor/pg_loss": -1.0, "actor/behaviour_kl_loss": kl, "actor/behaviour_kl_coef": 0.3,
                             "actor/pg_clipfrac": 1 / 3, "rollout_corr/is_clip_frac": 1 / 3})
