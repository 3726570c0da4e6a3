"""Several optimizer steps per batch (`algorithm.mini_batches`, `algorithm.epochs`) on the tiny float64 policy:
the split by groups, equality with sequential single steps, today's step kept bit for bit at 1 × 1 (π_prox taken
from its training passes, no pass up front), π_prox fixed for the batch, the behaviour-anchored losses' one-step forms through the real step, and the batch's metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.sections import LoraConfig
from asyncrl.config.loader import ConfigError
from learner.distributed import World
from learner.maths.advantages import compute_advantages
from learner.maths.batching import TrainBatch, collate
from learner.maths.logprobs import target_logprobs
from learner.maths.loss_terms import binary_kl, leaves_trust_region, ratio_from_log, second_moment_cutoff, truncated_weight
from learner.maths.losses import LossInputs, compute_policy_loss
from learner.maths.mini_batches import mini_batch_rows
from learner.policy.lora import add_adapters
from learner.policy.train_step import NEEDS_PROXIMAL, Passes, proximal_from_training_pass, rank_chunks, train_step
from policy_helpers import tiny_policy
from test_packed_training import groups

CPU_WORLD = World(rank=0, size=1, device=torch.device("cpu"))
PASSES = Passes(40, temperature=0.9)  # 40 tokens: each mini-batch takes several micro-batches
WEIGHT_TOLERANCE = 1e-12  # float64: different summation orders agree to about 1e-15


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same_weights(actual: list[torch.Tensor], expected: list[torch.Tensor], atol: float = WEIGHT_TOLERANCE) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=atol)


# ------------------------------------------------------------------------------------------- the split


def test_mini_batches_hold_whole_groups_in_even_runs():
    # groups by row: 0 0 1 2 2 2 3 4 4 → 5 groups into 2: groups (0, 1, 2) and (3, 4)
    group_index = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4])
    assert mini_batch_rows(group_index, 2) == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]
    # into 3: groups (0, 1), (2, 3), (4); groups in order of first appearance, whatever their numbers
    assert mini_batch_rows(torch.tensor([7, 7, 3, 9, 9, 9, 1, 5, 5]), 3) == [[0, 1, 2], [3, 4, 5, 6], [7, 8]]
    assert mini_batch_rows(group_index, 1) == [list(range(9))]
    with pytest.raises(ValueError, match=r"algorithm.mini_batches=6: the batch holds 5 groups"):
        mini_batch_rows(group_index, 6)


def test_more_mini_batches_than_groups_per_batch_is_a_config_error():
    with pytest.raises(ConfigError, match=r"algorithm.mini_batches: must not exceed buffer.batch_groups=4"):
        load_config(None, ["algorithm.mini_batches=5", "buffer.batch_groups=4"])
    assert load_config(None, ["algorithm.mini_batches=4", "buffer.batch_groups=4"]).algorithm.mini_batches == 4


# --------------------------------------------------------------- several steps = that many single steps


def steps(model, optimizer, batches: list[TrainBatch], algorithm: AlgorithmConfig) -> list[dict[str, float]]:
    return [train_step(model, optimizer, batch, algorithm, PASSES, 1.0, CPU_WORLD).metrics for batch in batches]


@pytest.mark.parametrize("loss", ["naive_ppo", "dppo_tv"])
def test_mini_batches_and_epochs_equal_sequential_single_steps(loss):
    # groups() holds 3 groups: mini_batches=2 takes groups (0, 1) then (2); epochs=2 takes them twice.
    # Losses anchored to π_behav only, with group-relative advantages: each step sees what a single step
    # on its groups would see, so the 4 steps must land where 4 single steps land.
    algorithm = AlgorithmConfig(loss=loss, mini_batches=2, epochs=2)
    model = tiny_policy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batched = train_step(model, optimizer, collate(groups(), 0), algorithm, PASSES, 1.0, CPU_WORLD).metrics

    single_model = tiny_policy()
    single_optimizer = torch.optim.AdamW(single_model.parameters(), lr=1e-2)
    halves = [collate(groups()[:2], 0), collate(groups()[2:], 0)]
    singles = steps(single_model, single_optimizer, halves * 2, AlgorithmConfig(loss=loss))

    assert_same_weights(weights(model), weights(single_model))
    assert not torch.equal(weights(model)[0], weights(tiny_policy())[0])  # the steps moved the weights
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "rollout_corr/mismatch_kl"):
        assert batched[key] == pytest.approx(sum(s[key] for s in singles) / 4, rel=1e-9, abs=1e-12), key
    assert batched["actor/optimizer_steps"] == 4.0
    assert batched["actor/pg_clipfrac_first_step"] == singles[0]["actor/pg_clipfrac"]
    assert batched["actor/pg_clipfrac_last_step"] == singles[-1]["actor/pg_clipfrac"]


def test_proximal_policy_is_the_one_that_started_the_batch():
    # decoupled PPO, one mini-batch per group, lr high enough that π_θ leaves the clip range within the batch:
    # the first step's π_θ is π_prox (no token clipped), later steps clip against the batch's π_prox
    algorithm = AlgorithmConfig(loss="decoupled_ppo", mini_batches=3, epochs=2)
    model = tiny_policy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    metrics = train_step(model, optimizer, collate(groups(), 0), algorithm, PASSES, 1.0, CPU_WORLD).metrics
    assert metrics["actor/pg_clipfrac_first_step"] == 0.0
    assert metrics["actor/pg_clipfrac_last_step"] > 0.0
    assert metrics["actor/pg_clipfrac"] > 0.0

    # the first mini-batch's step is a single step on its group; the second is not (its π_prox is older)
    batched, single = tiny_policy(), tiny_policy()
    batched_optimizer = torch.optim.AdamW(batched.parameters(), lr=5e-2)
    single_optimizer = torch.optim.AdamW(single.parameters(), lr=5e-2)
    train_step(batched, batched_optimizer, collate(groups()[:2], 0), AlgorithmConfig(loss="decoupled_ppo", mini_batches=2),
               PASSES, 1.0, CPU_WORLD)
    steps(single, single_optimizer, [collate(groups()[:1], 0), collate(groups()[1:2], 0)], AlgorithmConfig(loss="decoupled_ppo"))
    assert any(not torch.allclose(a, b, rtol=0, atol=1e-9) for a, b in zip(weights(batched), weights(single)))


# -------------------------------------------------------------------------- one step per batch, as before


def step_as_before(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: TrainBatch, algorithm: AlgorithmConfig) -> None:
    """One optimizer step on the whole batch, written out from the pieces as the learner took it before
    mini-batches: advantages, π_prox scored up front per micro-batch (trained positions only, as the learner scores
    them), accumulated backward, clip, update."""
    advantages = compute_advantages(batch.rewards, batch.group_index, batch.loss_mask, algorithm)  # [B, T-1]
    chunks = rank_chunks(batch, PASSES.micro_batch_tokens, CPU_WORLD)
    parts = [batch.select(chunk.rows) for chunk in chunks]
    with torch.no_grad():
        proximal = [target_logprobs(model, p.input_ids, p.attention_mask, PASSES.temperature, with_entropy=False,
                                    wanted=p.loss_mask)[0] for p in parts]
    optimizer.zero_grad(set_to_none=True)
    for chunk, part, anchor in zip(chunks, parts, proximal):
        logprobs, entropy = target_logprobs(model, part.input_ids, part.attention_mask, PASSES.temperature,
                                            wanted=part.loss_mask)
        inputs = LossInputs(logprobs, part.behaviour_logprobs, advantages[chunk.rows, : part.target_width], part.loss_mask,
                            anchor if algorithm.loss in NEEDS_PROXIMAL else None, None, entropy,
                            float(batch.loss_mask.sum()))
        loss, _ = compute_policy_loss(inputs, algorithm)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


@pytest.mark.parametrize("loss", ["decoupled_ppo", "decoupled_ppo_kl", "tis", "seq_mask", "naive_ppo"])
def test_one_mini_batch_one_epoch_is_the_step_as_before_bit_for_bit(loss):
    algorithm = AlgorithmConfig(loss=loss)
    new, before = tiny_policy(), tiny_policy()
    new_optimizer = torch.optim.AdamW(new.parameters(), lr=1e-2)
    before_optimizer = torch.optim.AdamW(before.parameters(), lr=1e-2)
    for _ in range(2):
        metrics = train_step(new, new_optimizer, collate(groups(), 0), algorithm, PASSES, 1.0, CPU_WORLD).metrics
        step_as_before(before, before_optimizer, collate(groups(), 0), algorithm)
    for a, b in zip(weights(new), weights(before)):
        assert torch.equal(a, b)
    assert "actor/optimizer_steps" not in metrics and "actor/pg_clipfrac_first_step" not in metrics


def forward_passes(model: torch.nn.Module, algorithm: AlgorithmConfig) -> int:
    """Forward passes of the policy's body in one train_step on the test's batch."""
    calls = []
    hook = model.model.register_forward_hook(lambda *args: calls.append(1))
    train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), collate(groups(), 0), algorithm, PASSES, 1.0,
               CPU_WORLD)
    hook.remove()
    return len(calls)


@pytest.mark.parametrize("algorithm, up_front", [
    (AlgorithmConfig(loss="decoupled_ppo_kl"), False),  # one step per batch: π_prox is the training pass's own
    (AlgorithmConfig(loss="decoupled_ppo", mini_batches=2), True),  # the second step's π_θ has moved on
    (AlgorithmConfig(loss="decoupled_ppo", epochs=2), True),
    (AlgorithmConfig(loss="m2po"), True),  # its cutoff needs the whole mini-batch's π_prox before the first pass
    (AlgorithmConfig(loss="tis"), False),  # no π_prox at all
])
def test_pi_prox_is_scored_up_front_only_where_a_training_pass_cannot_give_it(algorithm, up_front):
    chunks = sum(len(rank_chunks(collate(groups(), 0).select(rows), PASSES.micro_batch_tokens, CPU_WORLD))
                 for rows in mini_batch_rows(collate(groups(), 0).group_index, algorithm.mini_batches))
    training = chunks * algorithm.epochs
    assert forward_passes(tiny_policy(), algorithm) == training + (chunks if up_front else 0)
    assert proximal_from_training_pass(tiny_policy(), algorithm) == (algorithm.loss in NEEDS_PROXIMAL and not up_front)


def test_adapter_dropout_keeps_the_pass_up_front():
    """A training pass with dropout on the adapters is not the policy that scores: π_prox is scored without it."""
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj"])
    algorithm = AlgorithmConfig(loss="decoupled_ppo_kl")
    for dropout, up_front in ((0.0, False), (0.5, True)):
        model = tiny_policy()
        model = add_adapters(model, list(model.model.layers), dataclasses.replace(lora, dropout=dropout), torch.float64)
        assert proximal_from_training_pass(model, algorithm) == (not up_front)


# ------------------------------------------------- behaviour-anchored losses at one step per batch


def one_step_weight(loss: str, algorithm: AlgorithmConfig, prox: torch.Tensor, behaviour: torch.Tensor,
                    advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] w of the documented one-step gradient −w·∇log π_θ (π_θ = π_prox), per docs/losses.md."""
    rho = ratio_from_log(prox - behaviour)  # [B, T] π_prox/π_behav
    if loss in ("dppo_tv", "dppo_kl"):
        shift = prox.exp() - behaviour.exp()  # [B, T]
        divergence = shift.abs() if loss == "dppo_tv" else binary_kl(behaviour, prox)
        bound = algorithm.dppo_tv_bound if loss == "dppo_tv" else algorithm.dppo_kl_bound
        return torch.where(leaves_trust_region(divergence, bound, shift, advantages), 0.0, rho * advantages)
    if loss == "m2po":
        squared = (prox - behaviour).square()  # [B, T]
        cutoff = second_moment_cutoff(squared[mask.bool()], algorithm.m2_threshold)
        return torch.where(squared > cutoff, 0.0, rho * advantages)
    # decoupled_ppo_kl: the clip is inactive at r = 1; the penalty's gradient is β·(ρ − 1)
    return truncated_weight(prox - behaviour, algorithm.is_cap).weight * advantages - algorithm.behaviour_kl_coef * (rho - 1)


@pytest.mark.parametrize("loss, config", [
    ("dppo_tv", {}), ("dppo_kl", {}), ("m2po", {"m2_threshold": 1.0}), ("decoupled_ppo_kl", {"behaviour_kl_coef": 0.5}),
])
def test_behaviour_anchored_losses_reduce_to_their_one_step_form(loss, config):
    algorithm = AlgorithmConfig(loss=loss, **config)
    batch = collate(groups(), 0)
    model = tiny_policy()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # update = −gradient
    metrics = train_step(model, optimizer, batch, algorithm, PASSES, 0.0, CPU_WORLD).metrics

    expected_model = tiny_policy()
    logprobs, _ = target_logprobs(expected_model, batch.input_ids, batch.attention_mask, PASSES.temperature)  # [B, T-1]
    advantages = compute_advantages(batch.rewards, batch.group_index, batch.loss_mask, algorithm)  # [B, T-1]
    weight = one_step_weight(loss, algorithm, logprobs.detach(), batch.behaviour_logprobs, advantages, batch.loss_mask)
    surrogate = -(weight * logprobs)[batch.loss_mask.bool()].sum() / batch.loss_mask.sum()  # gradient −Σ w·∇log π / N
    surrogate.backward()
    expected = [p.detach() - p.grad for p in expected_model.parameters()]
    assert_same_weights(weights(model), expected, atol=1e-10)
    if "trust_region/masked_frac" in metrics:  # the mask engaged on some tokens and not on others
        assert 0.0 < metrics["trust_region/masked_frac"] < 1.0
