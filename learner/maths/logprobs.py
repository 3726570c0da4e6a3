"""Per-token log-probabilities (and entropies) of the target tokens under the policy, at the sampling
temperature, straight from the final hidden states: no [tokens, vocab] tensor of a whole micro-batch ever
exists, in forward or backward.

`LinearTargetLogprob` multiplies the hidden states by the output projection a chunk of rows at a time
(at most `CHUNK_ELEMENTS` logits), keeps one log-normaliser per row, and recomputes each chunk's logits in
backward. With a 151,936-token vocabulary, full float32 logits of a 32k-token micro-batch would be 20 GB,
plus as much again for their gradient; a chunk is 0.5 GB. On a GPU, the elementwise work on a chunk (the
float32 softmax statistics, the logits' gradient) is fused by torch.compile into a few kernels, so each
chunk's logits are read about once per pass instead of once per operation.

The model runs its decoder through `score_targets`, a method attached to the policy (`attach_scoring`) that
FSDP treats like `forward`, so the sharded output projection is gathered for it.
"""

from __future__ import annotations

import functools
from types import MethodType
from typing import Callable

import torch
from torch import Tensor

from asyncrl.config.rollout import RolloutConfig
from learner.maths.packing import ModelInputs, packed_inputs, padded_inputs

CHUNK_ELEMENTS = 2**28  # logits per working chunk (0.5 GB in bf16): bounds the temporaries, not the result
PROCESSED = "processed_logprobs"  # vLLM reports log-probs of the tempered distribution it samples from
SCORING_METHOD = "score_targets"  # the policy's method that runs the decoder and the fused head


def sampling_temperature(rollout: RolloutConfig) -> float:
    """The temperature the learner divides logits by so that π matches the behaviour log-probs' scale:
    the sampling temperature where vLLM reports processed log-probs, 1 for raw ones or greedy sampling."""
    temperature = rollout.sampling.temperature
    if rollout.engine.logprobs_mode != PROCESSED or temperature <= 0:
        return 1.0
    return temperature


def target_logprobs(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0,
    with_entropy: bool = True, packed: bool = False, wanted: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log π(token_{t+1} | tokens_≤t) with π = softmax(logits / temperature), and the entropy of π at t
    (detached; None without `with_entropy`), both [b, T-1] in float32 (float64 for a float64 model), 0 where
    the row has no token at t + 1. `packed` runs the rows' real tokens as one sequence (no padding FLOPs);
    the values are the same either way, up to float rounding. `wanted` ([b, T-1], a loss mask): only those
    positions are scored, the others hold 0; the output head never runs for prompt positions, so with a
    large vocabulary a step costs what its completion tokens need (None: every position is scored)."""
    inputs = packed_inputs(input_ids, attention_mask) if packed else padded_inputs(input_ids, attention_mask)
    if wanted is not None:
        inputs = inputs.only(wanted.bool())
    chosen, entropy = getattr(model, SCORING_METHOD)(inputs, temperature, with_entropy)  # [M] each
    return inputs.to_target_positions(chosen), None if entropy is None else inputs.to_target_positions(entropy)


def attach_scoring(model: torch.nn.Module) -> torch.nn.Module:
    """Give a Hugging Face causal LM the `score_targets` method (before sharding, FSDP must register it)."""
    check_output_head(model)
    setattr(model, SCORING_METHOD, MethodType(_score_targets, model))
    return model


def check_output_head(model: torch.nn.Module) -> None:
    """The fused head computes hidden · Wᵀ only: refuse models whose logits are more than that."""
    head = model.get_output_embeddings()
    config = model.config
    extras = [name for name in ("final_logit_softcapping", "logit_scale") if getattr(config, name, None)]
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or extras:
        raise ValueError(f"{type(model).__name__}: the learner needs an output head that is a plain linear layer "
                         f"without bias or logit transforms (found {type(head).__name__}{', ' if extras else ''}"
                         f"{', '.join(extras)})")


def _score_targets(self: torch.nn.Module, inputs: ModelInputs, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    decoder = self.get_decoder()
    hidden = decoder(
        input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids,
        use_cache=False, **inputs.attention_kwargs,
    ).last_hidden_state  # [B, T, H]
    scored = hidden.reshape(-1, hidden.shape[-1])[inputs.scored]  # [M, H]: the head runs for these rows only
    weight = self.get_output_embeddings().weight  # [V, H]
    return LinearTargetLogprob.apply(scored, weight, inputs.targets[inputs.scored], temperature, CHUNK_ELEMENTS,
                                     with_entropy)


class LinearTargetLogprob(torch.autograd.Function):
    """(log-prob of each row's target, entropy of each row or None) of softmax(hidden · Wᵀ / temperature); the
    gradient flows to hidden and W through the log-prob only."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                chunk_elements: int = CHUNK_ELEMENTS, with_entropy: bool = True):
        # hidden [N, H], weight [V, H] (model dtype), targets [N] → chosen [N], entropy [N] or None (working dtype)
        rows = hidden.shape[0]
        chosen = torch.empty(rows, dtype=_working_dtype(hidden), device=hidden.device)  # [N]
        entropy = torch.empty_like(chosen) if with_entropy else None  # [N]
        normaliser = torch.empty_like(chosen)  # [N] logsumexp of the tempered logits
        scores = _kernel(_chunk_scores, hidden.device)
        for part in _row_chunks(rows, weight.shape[0], chunk_elements):
            logits = hidden[part] @ weight.T  # [n, V] model dtype
            chosen[part], normaliser[part], part_entropy = scores(logits, targets[part], temperature, with_entropy)
            if entropy is not None:
                entropy[part] = part_entropy
        ctx.save_for_backward(hidden, weight, targets, normaliser)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_chosen: Tensor, _grad_entropy: Tensor):
        hidden, weight, targets, normaliser = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)  # [N, H]
        # a frozen head (LoRA) gets no gradient: neither its [V, H] buffers nor its matmuls
        trains_head = ctx.needs_input_grad[1]
        grad_weight = torch.zeros_like(weight, dtype=normaliser.dtype) if trains_head else None  # [V, H] over chunks
        gradient = _kernel(_chunk_logit_gradient, hidden.device)
        for part in _row_chunks(hidden.shape[0], weight.shape[0], ctx.chunk_elements):
            logits = hidden[part] @ weight.T  # [n, V] recomputed
            grad_logits = gradient(logits, targets[part], normaliser[part], grad_chosen[part], ctx.temperature)  # [n, V]
            grad_hidden[part] = grad_logits @ weight  # [n, H]
            if grad_weight is not None:
                grad_weight += grad_logits.T @ hidden[part]  # [V, H]
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None


def _chunk_scores(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    """logits [n, V] (model dtype), targets [n] → log-prob of the target [n], logsumexp [n], entropy [n] or None,
    in the working dtype, of softmax(logits / temperature)."""
    scaled = logits.to(_working_dtype(logits)) / temperature  # [n, V]
    lse = torch.logsumexp(scaled, dim=-1)  # [n]
    chosen = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [n]
    if not with_entropy:
        return chosen, lse, None
    probs = torch.exp(scaled - lse.unsqueeze(-1))  # [n, V]
    return chosen, lse, lse - (probs * scaled).sum(dim=-1)


def _chunk_logit_gradient(logits: Tensor, targets: Tensor, lse: Tensor, upstream: Tensor, temperature: float) -> Tensor:
    """d(upstream · log p_target)/d logits = upstream · (1[j = target] − p_j) / temperature: [n, V] in the model dtype."""
    scaled = logits.to(lse.dtype) / temperature  # [n, V]
    probs = torch.exp(scaled - lse.unsqueeze(-1))  # [n, V]
    is_target = torch.arange(logits.shape[-1], device=logits.device) == targets.unsqueeze(-1)  # [n, V]
    return (upstream.unsqueeze(-1) * (is_target.to(probs.dtype) - probs) / temperature).to(logits.dtype)


def _chunk_scores_in_place(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    """`_chunk_scores` for eager devices (the CPU): `logits` [n, V], a temporary of the caller's, is overwritten,
    so that each step is one pass over it (the entropy's probabilities are the one other [n, V] tensor made)."""
    scaled = _scaled_in_place(logits, temperature)  # [n, V]
    lse = torch.logsumexp(scaled, dim=-1)  # [n]
    chosen = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [n]
    if not with_entropy:
        return chosen, lse, None
    expected = torch.exp(scaled.sub_(lse.unsqueeze(-1))).mul_(scaled).sum(dim=-1)  # [n]: Σ p_j (s_j − lse)
    return chosen, lse, -expected


def _chunk_logit_gradient_in_place(logits: Tensor, targets: Tensor, lse: Tensor, upstream: Tensor,
                                   temperature: float) -> Tensor:
    """`_chunk_logit_gradient` for eager devices: `logits` [n, V] is overwritten and returned as the gradient."""
    scale = (upstream / temperature).unsqueeze(-1)  # [n, 1]
    gradient = _scaled_in_place(logits, temperature).sub_(lse.unsqueeze(-1)).exp_().mul_(-scale)  # −upstream·p / T
    gradient.scatter_add_(-1, targets.unsqueeze(-1), scale.to(gradient.dtype))  # + upstream / T at the target
    return gradient.to(logits.dtype)


def _scaled_in_place(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature in the working dtype, in `logits` itself where it already has that dtype."""
    working = logits if logits.dtype == _working_dtype(logits) else logits.to(_working_dtype(logits))
    return working if temperature == 1.0 else working.div_(temperature)


@functools.cache
def _compiled(function: Callable) -> Callable:
    return torch.compile(function, dynamic=True)


EAGER = {_chunk_scores: _chunk_scores_in_place, _chunk_logit_gradient: _chunk_logit_gradient_in_place}


def _kernel(function: Callable, device: torch.device) -> Callable:
    """`function` fused into a few GPU kernels by torch.compile on CUDA (each [n, V] temporary would otherwise
    be a pass over memory), as it is elsewhere; elsewhere its in-place form, one pass per step over the chunk."""
    return _compiled(function) if device.type == "cuda" else EAGER[function]


def _working_dtype(tensor: Tensor) -> torch.dtype:
    """float32 for half-precision models (bf16 cannot hold a log-normaliser precisely), float64 kept."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _row_chunks(rows: int, vocab: int, chunk_elements: int) -> list[slice]:
    step = max(1, chunk_elements // max(vocab, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]
