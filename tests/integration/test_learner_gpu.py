"""On a CUDA GPU in bf16: the variable-length attention kernel equals causal sdpa run on each sample alone
(values and gradients, grouped-query heads); a packed micro-batch scores the same log-probs as a padded one
through a real Qwen2-shaped model, with each activation checkpointing mode; the fused head equals float64
log_softmax; a step with CPU offload trains like one without; and a resume restores the CUDA generator."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.learner import LearnerConfig
from learner.maths import attention
from learner.maths.batching import collate
from learner.maths.logprobs import LinearTargetLogprob, attach_scoring, target_logprobs
from learner.policy.activation_checkpointing import MODES, apply_activation_checkpointing
from learner.policy.checkpoint import load_checkpoint, save_checkpoint
from learner.policy.policy_model import PinnedWeights, full_weights, shard_policy
from learner.policy.train_step import Passes, train_step
from learner_helpers import random_groups, single_rank_world

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16_RELATIVE = 2e-2  # ‖fast − reference‖ / ‖reference‖ allowed in bf16 (rounding of 8-bit mantissas)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.detach().double() - reference.detach().double()).norm() / reference.detach().double().norm())


def test_varlen_kernel_equals_sdpa_per_sample():
    lengths = [700, 3, 1024, 129, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    tokens, heads, kv_heads, dim = sum(lengths), 14, 2, 64
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, h, dim, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    kernel = attention.varlen_kernel(q.device, q.dtype)
    assert kernel is not attention.per_sample_attention, "no variable-length kernel found on this GPU"
    upstream = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    fast = kernel(q, k, v, cu, max(lengths), dim ** -0.5)
    fast_grads = torch.autograd.grad((fast * upstream).sum(), (q, k, v))
    slow = attention.per_sample_attention(q, k, v, cu, max(lengths), dim ** -0.5)
    slow_grads = torch.autograd.grad((slow * upstream).sum(), (q, k, v))
    assert relative_error(fast, slow) < BF16_RELATIVE
    for fast_grad, slow_grad in zip(fast_grads, slow_grads):
        assert relative_error(fast_grad, slow_grad) < BF16_RELATIVE


def tiny_qwen2() -> Qwen2ForCausalLM:
    """Head size 64 (what the flash kernels take), grouped-query heads, tied head, loaded with the learner's attention."""
    config = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation(attention.register())
    return model


@pytest.mark.parametrize("checkpointing", MODES)
def test_packed_and_padded_log_probs_and_gradients_agree(checkpointing):
    results = {}
    for packed in (False, True):
        torch.manual_seed(0)
        model = tiny_qwen2().to("cuda", torch.bfloat16)
        attach_scoring(model)
        apply_activation_checkpointing(list(model.model.layers), checkpointing)
        generator = torch.Generator().manual_seed(1)
        input_ids = torch.randint(1, 1000, (4, 300), generator=generator)
        attention_mask = torch.zeros_like(input_ids)
        for row, length in enumerate((300, 17, 250, 2)):
            attention_mask[row, :length] = 1
        input_ids, attention_mask = input_ids.cuda() * attention_mask.cuda(), attention_mask.cuda()
        chosen, _ = target_logprobs(model, input_ids, attention_mask, 0.9, packed=packed)
        real = attention_mask[:, 1:].bool()
        chosen[real].sum().backward()
        results[packed] = (chosen[real].detach(), model.model.layers[0].mlp.down_proj.weight.grad.clone())
    assert relative_error(results[True][0], results[False][0]) < BF16_RELATIVE
    assert relative_error(results[True][1], results[False][1]) < 5 * BF16_RELATIVE  # a sum over 566 bf16 terms


def test_fused_head_on_the_gpu_equals_float64_log_softmax():
    generator = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(3000, 256, device="cuda", generator=generator).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(5000, 256, device="cuda", generator=generator) / 8).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 5000, (3000,), device="cuda", generator=generator)
    chosen, entropy = LinearTargetLogprob.apply(hidden, weight, targets, 0.7, 5000 * 700)  # 5 chunks, the last short
    chosen.sum().backward()
    plain_hidden = hidden.detach().double().requires_grad_()
    plain_weight = weight.detach().double().requires_grad_()
    log_probs = torch.log_softmax(plain_hidden @ plain_weight.T / 0.7, dim=-1)
    expected = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected.sum().backward()
    assert relative_error(chosen, expected) < 5e-3  # the logits themselves are rounded to bf16 by the matmul
    assert relative_error(entropy, -(log_probs.exp() * log_probs).sum(-1)) < 5e-3
    assert relative_error(hidden.grad, plain_hidden.grad) < BF16_RELATIVE
    assert relative_error(weight.grad, plain_weight.grad) < BF16_RELATIVE


def test_cpu_offload_trains_like_the_gpu_and_its_weights_gather():
    """One NCCL rank: a step with weights, gradients and AdamW state in CPU memory updates the weights as the
    same step on the GPU does (bf16 compute both ways), and the weights gather for a sync."""
    groups = random_groups(0, groups=4, samples=4)
    updates = {}
    with single_rank_world("cuda", cpu_collectives=True) as world:  # as the learner starts with cpu_offload
        for offload in (False, True):
            torch.manual_seed(0)
            model = tiny_qwen2().to(torch.float32)
            initial = {name: p.detach().clone() for name, p in model.named_parameters()}
            model = shard_policy(model, LearnerConfig(cpu_offload=offload), world)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            outcome = train_step(model, optimizer, collate(groups, 0), AlgorithmConfig(), Passes(4096, packed=True), 1.0, world)
            assert outcome.finite
            weights = dict(full_weights(model, torch.float32, world.device, keep=True))  # float32: norms move by 1e-3
            assert all(w.device.type == "cuda" and w.dtype == torch.float32 for w in weights.values())
            updates[offload] = {name: weights[name].float().cpu() - initial[name].cpu() for name in initial}
    moved = [name for name, update in updates[False].items() if update.abs().max() > 0]
    assert len(moved) == len(updates[False])
    for name in moved:
        assert relative_error(updates[True][name], updates[False][name]) < 0.1, name  # bf16 gradients, Adam's sign-like steps


def test_a_resumed_gpu_rank_draws_the_same_cuda_random_numbers(tmp_path):
    with single_rank_world("cuda") as world:
        model = shard_policy(tiny_qwen2(), LearnerConfig(), world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.cuda.manual_seed(7)
        torch.rand(3, device="cuda")  # a generator somewhere past its seed
        path = save_checkpoint(tmp_path, 1, model, optimizer, {"buffer_offset": 0}, world, keep=1)
        expected = torch.rand(5, device="cuda")
        torch.rand(100, device="cuda")
        load_checkpoint(path, model, optimizer, world)
        assert torch.equal(torch.rand(5, device="cuda"), expected)


def test_weights_gathered_into_pinned_memory_equal_a_plain_copy_and_reuse_it_each_round():
    """A GPU learner whose weights go to CPU memory for a sync: the pinned copies hold exactly the cast weights,
    and a second round refills the same page-locked tensors with the changed values."""
    with single_rank_world("cuda") as world:
        model = shard_policy(tiny_qwen2().to(torch.float32), LearnerConfig(), world)
        pinned = PinnedWeights()
        cpu = torch.device("cpu")
        first = full_weights(model, torch.bfloat16, cpu, keep=True, pinned=pinned)
        plain = dict(full_weights(model, torch.bfloat16, cpu, keep=True))
        assert all(tensor.is_pinned() and tensor.dtype == torch.bfloat16 for _, tensor in first)
        assert all(torch.equal(tensor, plain[name]) for name, tensor in first)
        addresses = [tensor.data_ptr() for _, tensor in first]
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        second = full_weights(model, torch.bfloat16, cpu, keep=True, pinned=pinned)
        after = dict(full_weights(model, torch.bfloat16, cpu, keep=True))
        assert [tensor.data_ptr() for _, tensor in second] == addresses
        assert all(torch.equal(tensor, after[name]) and not torch.equal(tensor, plain[name]) for name, tensor in second)
