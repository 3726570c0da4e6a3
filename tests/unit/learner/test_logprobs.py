"""Target log-probs and entropies computed chunk by chunk at a temperature, against the plain float64
formulas: values, gradients through the log-prob only, chunk boundaries, and the temperature rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncrl.config.rollout import EngineConfig, RolloutConfig, SamplingConfig
from learner.logprobs import TargetLogprob, sampling_temperature, target_logprobs

VOCAB = 11
TOLERANCE = 1e-10  # float64 throughout: the chunked and plain paths may differ only by rounding


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_elements", [VOCAB, 3 * VOCAB, 10**6])  # one row, three rows, all rows per chunk
def test_values_and_gradient_equal_the_plain_formulas(temperature, chunk_elements):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, VOCAB, dtype=torch.float64, generator=generator) * 3
    targets = torch.randint(0, VOCAB, (7,), generator=generator)
    upstream = torch.randn(7, dtype=torch.float64, generator=generator)

    fast = logits.clone().requires_grad_()
    chosen, entropy = TargetLogprob.apply(fast, targets, temperature, chunk_elements)
    (chosen * upstream).sum().backward()
    plain = logits.clone().requires_grad_()
    expected_chosen, expected_entropy = reference(plain, targets, temperature)
    (expected_chosen * upstream).sum().backward()

    assert chosen.dtype == torch.float64  # float64 logits are worked on in float64
    assert torch.allclose(chosen, expected_chosen, atol=TOLERANCE)
    assert torch.allclose(entropy, expected_entropy, atol=TOLERANCE)
    assert torch.allclose(fast.grad, plain.grad, atol=TOLERANCE)


def test_gradcheck_and_entropy_carries_no_gradient():
    logits = torch.randn(4, VOCAB, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 3])
    assert torch.autograd.gradcheck(lambda x: TargetLogprob.apply(x, targets, 0.8, 2 * VOCAB)[0], (logits,))
    _, entropy = TargetLogprob.apply(logits, targets, 0.8)
    assert not entropy.requires_grad


def test_hand_computed_values_at_temperature_two():
    # logits [0, ln 4] at T = 2 → tempered [0, ln 2] → p = [1/3, 2/3]
    logits = torch.tensor([[0.0, torch.log(torch.tensor(4.0)).item()]], dtype=torch.float64)
    chosen, entropy = TargetLogprob.apply(logits, torch.tensor([1]), 2.0)
    assert chosen.item() == pytest.approx(torch.log(torch.tensor(2 / 3)).item(), abs=1e-6)
    expected_entropy = -(1 / 3 * torch.log(torch.tensor(1 / 3)) + 2 / 3 * torch.log(torch.tensor(2 / 3))).item()
    assert entropy.item() == pytest.approx(expected_entropy, abs=1e-6)


def test_half_precision_logits_are_worked_on_in_float32():
    logits = (torch.randn(3, VOCAB) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.tensor([1, 2, 3])
    chosen, _ = TargetLogprob.apply(logits, targets, 1.0)
    chosen.sum().backward()
    expected, _ = reference(logits.detach().double(), targets, 1.0)
    assert chosen.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    assert torch.allclose(chosen.double(), expected, atol=1e-5)


def test_target_logprobs_score_the_next_token_of_every_position():
    logits = torch.randn(2, 5, VOCAB)

    class Fixed(torch.nn.Module):
        def forward(self, input_ids, attention_mask, use_cache):
            return SimpleNamespace(logits=logits)

    input_ids = torch.randint(0, VOCAB, (2, 5))
    chosen, entropy = target_logprobs(Fixed(), input_ids, torch.ones_like(input_ids), temperature=0.5)
    expected_chosen, expected_entropy = reference(logits[:, :-1].double(), input_ids[:, 1:], 0.5)
    assert chosen.shape == entropy.shape == (2, 4)
    assert torch.allclose(chosen.double(), expected_chosen, atol=1e-5)
    assert torch.allclose(entropy.double(), expected_entropy, atol=1e-5)


def test_log_probs_without_entropy_are_the_same_and_still_differentiable():
    logits = torch.randn(2, 5, VOCAB, requires_grad=True)

    class Fixed(torch.nn.Module):
        def forward(self, input_ids, attention_mask, use_cache):
            return SimpleNamespace(logits=logits)

    input_ids = torch.randint(0, VOCAB, (2, 5))
    with_entropy, _ = target_logprobs(Fixed(), input_ids, torch.ones_like(input_ids), temperature=0.5)
    chosen, entropy = target_logprobs(Fixed(), input_ids, torch.ones_like(input_ids), 0.5, with_entropy=False)
    assert entropy is None
    assert torch.equal(chosen, with_entropy)
    chosen.sum().backward()
    expected_grad, = torch.autograd.grad(with_entropy.sum(), logits)
    assert torch.allclose(logits.grad, expected_grad)


@pytest.mark.parametrize(
    ("mode", "temperature", "expected"),
    [("processed_logprobs", 0.7, 0.7), ("raw_logprobs", 0.7, 1.0), ("processed_logprobs", 0.0, 1.0)],
)
def test_learner_temperature_follows_the_servers_log_prob_mode(mode, temperature, expected):
    rollout = RolloutConfig(engine=EngineConfig(logprobs_mode=mode), sampling=SamplingConfig(temperature=temperature))
    assert sampling_temperature(rollout) == expected
