"""Target log-probs and entropies straight from hidden states, chunk by chunk at a temperature, against the
plain float64 formulas over full logits: values, gradients (to the hidden states and the output weight),
chunk boundaries, and the temperature rule; then through a real (tiny) Qwen2 model, padded and packed."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config.rollout import EngineConfig, RolloutConfig, SamplingConfig
from learner.maths.logprobs import LinearTargetLogprob, attach_scoring, sampling_temperature, target_logprobs
from policy_helpers import tiny_policy

VOCAB, HIDDEN = 11, 5
TOLERANCE = 1e-10  # float64 throughout: the chunked and plain paths may differ only by rounding


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


def random_head(rows: int, dtype=torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, dtype=dtype, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, dtype=dtype, generator=generator) * 2
    targets = torch.randint(0, VOCAB, (rows,), generator=generator)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_elements", [VOCAB, 3 * VOCAB, 10**6])  # one row, three rows, all rows per chunk
def test_values_and_gradients_equal_log_softmax_of_the_full_logits(temperature, chunk_elements):
    hidden, weight, targets = random_head(7)
    upstream = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    fast_hidden, fast_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    chosen, entropy = LinearTargetLogprob.apply(fast_hidden, fast_weight, targets, temperature, chunk_elements)
    (chosen * upstream).sum().backward()
    plain_hidden, plain_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected_chosen, expected_entropy = reference(plain_hidden @ plain_weight.T, targets, temperature)
    (expected_chosen * upstream).sum().backward()

    assert chosen.dtype == torch.float64  # a float64 model is worked on in float64
    assert torch.allclose(chosen, expected_chosen, atol=TOLERANCE)
    assert torch.allclose(entropy, expected_entropy, atol=TOLERANCE)
    assert torch.allclose(fast_hidden.grad, plain_hidden.grad, atol=TOLERANCE)
    assert torch.allclose(fast_weight.grad, plain_weight.grad, atol=TOLERANCE)


def test_gradcheck_and_entropy_carries_no_gradient():
    hidden, weight, targets = random_head(4)
    hidden.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w: LinearTargetLogprob.apply(h, w, targets, 0.8, 2 * VOCAB)[0], (hidden, weight))
    _, entropy = LinearTargetLogprob.apply(hidden, weight, targets, 0.8)
    assert not entropy.requires_grad


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_the_same_one(monkeypatch):
    """LoRA freezes the output head: its [V, H] gradient is neither allocated nor computed."""
    hidden, weight, targets = random_head(6)
    trained_hidden, trained_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    LinearTargetLogprob.apply(trained_hidden, trained_weight, targets, 0.9, 2 * VOCAB)[0].sum().backward()
    head_buffers = []
    zeros_like = torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda *a, **k: head_buffers.append(a[0].shape) or zeros_like(*a, **k))
    frozen_hidden, frozen_weight = hidden.clone().requires_grad_(), weight.clone()
    LinearTargetLogprob.apply(frozen_hidden, frozen_weight, targets, 0.9, 2 * VOCAB)[0].sum().backward()

    assert frozen_weight.grad is None and head_buffers == []
    assert torch.allclose(frozen_hidden.grad, trained_hidden.grad, atol=TOLERANCE)


def test_hand_computed_values_at_temperature_two():
    # hidden [1] · W = logits [0, ln 4] at T = 2 → tempered [0, ln 2] → p = [1/3, 2/3]
    hidden = torch.tensor([[1.0]], dtype=torch.float64)
    weight = torch.tensor([[0.0], [math.log(4.0)]], dtype=torch.float64)
    chosen, entropy = LinearTargetLogprob.apply(hidden, weight, torch.tensor([1]), 2.0)
    assert chosen.item() == pytest.approx(math.log(2 / 3), abs=1e-12)
    assert entropy.item() == pytest.approx(-(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3)), abs=1e-12)


def test_a_half_precision_model_is_worked_on_in_float32():
    hidden, weight, targets = random_head(3, dtype=torch.float32)
    hidden, weight = hidden.to(torch.bfloat16).requires_grad_(), weight.to(torch.bfloat16).requires_grad_()
    chosen, _ = LinearTargetLogprob.apply(hidden, weight, targets, 1.0)
    chosen.sum().backward()
    expected, _ = reference(hidden.detach().double() @ weight.detach().double().T, targets, 1.0)
    assert chosen.dtype == torch.float32
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert torch.allclose(chosen.double(), expected, atol=0.05)  # bf16 logits: ~3 significant digits


def test_without_entropy_the_log_probs_are_the_same():
    hidden, weight, targets = random_head(6)
    with_entropy, _ = LinearTargetLogprob.apply(hidden, weight, targets, 0.5, 2 * VOCAB, True)
    chosen, entropy = LinearTargetLogprob.apply(hidden, weight, targets, 0.5, 2 * VOCAB, False)
    assert entropy is None and torch.equal(chosen, with_entropy)


def padded_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three right-padded rows of 9, 5 and 2 tokens."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, vocab, (3, 9), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate((9, 5, 2)):
        attention_mask[row, :length] = 1
    return input_ids * attention_mask, attention_mask


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_a_model_scores_the_next_token_of_every_real_position(packed, temperature):
    model = tiny_policy()
    input_ids, attention_mask = padded_rows(model.config.vocab_size)
    chosen, entropy = target_logprobs(model, input_ids, attention_mask, temperature, packed=packed)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [3, 9, V] float64
    expected_chosen, expected_entropy = reference(logits[:, :-1], input_ids[:, 1:], temperature)
    real = attention_mask[:, 1:].bool()
    assert chosen.shape == entropy.shape == (3, 8)
    assert torch.allclose(chosen[real], expected_chosen[real], atol=1e-10)
    assert torch.allclose(entropy[real], expected_entropy[real], atol=1e-10)
    if packed:  # nothing is computed for padding: it holds 0
        assert torch.equal(chosen[~real], torch.zeros_like(chosen[~real]))


def test_packed_and_padded_give_the_same_gradients():
    grads = {}
    for packed in (False, True):
        model = tiny_policy()
        input_ids, attention_mask = padded_rows(model.config.vocab_size)
        chosen, _ = target_logprobs(model, input_ids, attention_mask, 0.8, packed=packed)
        weights = torch.linspace(-1, 1, chosen.numel(), dtype=chosen.dtype).view_as(chosen)
        (chosen * weights * attention_mask[:, 1:]).sum().backward()
        grads[packed] = {name: p.grad.clone() for name, p in model.named_parameters()}
    for name, grad in grads[False].items():
        assert torch.allclose(grads[True][name], grad, atol=1e-10), name


def test_a_packed_sample_never_attends_to_the_one_before_it():
    model = tiny_policy()
    input_ids, attention_mask = padded_rows(model.config.vocab_size)
    before, _ = target_logprobs(model, input_ids, attention_mask, packed=True)
    changed = input_ids.clone()
    changed[0, :9] = (changed[0, :9] % (model.config.vocab_size - 2)) + 1  # every token of the first sample
    after, _ = target_logprobs(model, changed, attention_mask, packed=True)
    assert not torch.allclose(after[0], before[0])  # the change is visible where it belongs
    assert torch.equal(after[1:], before[1:])  # and nowhere else


def test_models_whose_logits_are_not_a_plain_projection_are_refused():
    model = tiny_policy()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        attach_scoring(model)


@pytest.mark.parametrize(
    ("mode", "temperature", "expected"),
    [("processed_logprobs", 0.7, 0.7), ("raw_logprobs", 0.7, 1.0), ("processed_logprobs", 0.0, 1.0)],
)
def test_learner_temperature_follows_the_servers_log_prob_mode(mode, temperature, expected):
    rollout = RolloutConfig(engine=EngineConfig(logprobs_mode=mode), sampling=SamplingConfig(temperature=temperature))
    assert sampling_temperature(rollout) == expected


def completion_mask(attention_mask: torch.Tensor, prompt: int = 3) -> torch.Tensor:
    """[b, T-1] the target positions of each row's completion (the tokens after its first `prompt`), as
    `learner.maths.batching` marks them in the loss mask; a row of `prompt` tokens or fewer has none."""
    positions = torch.arange(attention_mask.shape[1] - 1)  # [T-1]
    return (positions >= prompt - 1) & attention_mask[:, 1:].bool()  # [b, T-1]


@pytest.mark.parametrize("packed", [False, True])  # packed: three samples back to back in one sequence
def test_scoring_only_the_trained_positions_equals_the_full_computation(packed, monkeypatch):
    model = tiny_policy()
    input_ids, attention_mask = padded_rows(model.config.vocab_size)  # rows of 9, 5 and 2 tokens
    wanted = completion_mask(attention_mask)  # 6 + 2 + 0 positions
    full, full_entropy = target_logprobs(model, input_ids, attention_mask, 0.8, packed=packed)  # every position
    weights = torch.linspace(-1, 1, full.numel(), dtype=full.dtype).view_as(full) * wanted
    (full * weights).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    head_rows = []
    apply = LinearTargetLogprob.apply
    monkeypatch.setattr(LinearTargetLogprob, "apply", lambda hidden, *rest: head_rows.append(len(hidden)) or apply(hidden, *rest))
    chosen, entropy = target_logprobs(model, input_ids, attention_mask, 0.8, packed=packed, wanted=wanted.float())
    (chosen * weights).sum().backward()

    assert head_rows == [int(wanted.sum())]  # the output head ran for the completion positions only
    assert torch.allclose(chosen, full * wanted, atol=1e-12, rtol=0)  # equal where wanted, 0 elsewhere
    assert torch.allclose(entropy, full_entropy * wanted, atol=1e-12, rtol=0)
    for name, parameter in model.named_parameters():
        assert torch.allclose(parameter.grad, expected_grads[name], atol=1e-12, rtol=0), name


def test_no_wanted_position_scores_nothing_and_still_backpropagates():
    # a micro-batch whose samples have no trained token (all tool output, say) still runs backward on every rank
    model = tiny_policy()
    input_ids, attention_mask = padded_rows(model.config.vocab_size)
    chosen, _ = target_logprobs(model, input_ids, attention_mask, wanted=torch.zeros(3, 8, dtype=torch.bool))
    assert torch.equal(chosen, torch.zeros(3, 8, dtype=chosen.dtype))
    chosen.sum().backward()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_in_place_chunk_steps_of_eager_devices_equal_the_compiled_ones(temperature, dtype):
    """The CPU runs the in-place forms; CUDA compiles the plain ones: both must give the same numbers."""
    from learner.maths.logprobs import _chunk_logit_gradient, _chunk_scores, _kernel

    hidden, weight, targets = random_head(4)
    logits = (hidden @ weight.T).to(dtype)  # [4, V]
    lse = _chunk_scores(logits, targets, temperature, True)[1]
    upstream = torch.linspace(-1.0, 2.0, 4, dtype=lse.dtype)
    cpu = torch.device("cpu")
    plain = (*_chunk_scores(logits, targets, temperature, True), _chunk_logit_gradient(logits, targets, lse, upstream, temperature))
    in_place = (*_kernel(_chunk_scores, cpu)(logits.clone(), targets, temperature, True),
                _kernel(_chunk_logit_gradient, cpu)(logits.clone(), targets, lse, upstream, temperature))
    assert [t.dtype for t in in_place] == [t.dtype for t in plain]
    for ours, theirs in zip(in_place, plain):
        assert torch.allclose(ours.double(), theirs.double(), atol=1e-12 if dtype == torch.float64 else 1e-2)
