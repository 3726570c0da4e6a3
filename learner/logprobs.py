"""Per-token log-probabilities (and entropies) of the target tokens under a causal LM, at the sampling
temperature, without materialising the vocabulary-wide float32 tensors.

A plain `log_softmax(logits.float())` keeps a float32 copy of every logit for backward and allocates
several more for the entropy: with a 151,936-token vocabulary that is ~10 GB per tensor for 16k tokens
(it ran an H200 out of memory). `TargetLogprob` works through the logits in row chunks of at most
`CHUNK_ELEMENTS` values, keeps only the logits the model already produced plus one log-normaliser per
row, and recomputes the softmax chunk by chunk in backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.config.rollout import RolloutConfig

CHUNK_ELEMENTS = 2**26  # float32 values per working chunk (256 MB): bounds the temporaries, not the result
PROCESSED = "processed_logprobs"  # vLLM reports log-probs of the tempered distribution it samples from


def sampling_temperature(rollout: RolloutConfig) -> float:
    """The temperature the learner divides logits by so that π matches the behaviour log-probs' scale:
    the sampling temperature where vLLM reports processed log-probs, 1 for raw ones or greedy sampling."""
    temperature = rollout.sampling.temperature
    if rollout.engine.logprobs_mode != PROCESSED or temperature <= 0:
        return 1.0
    return temperature


def target_logprobs(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log π(token_{t+1} | tokens_≤t) with π = softmax(logits / temperature), and the entropy of π at t
    (detached; None without `with_entropy`, which saves two vocabulary-wide passes), both [B, T-1] in
    float32 (float64 for float64 logits)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    batch, length, vocab = logits.shape
    # Every position gets a target (the last one a dummy, dropped below) so the logits stay one
    # contiguous [B·T, V] view instead of a sliced copy.
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)  # [B, T]
    chosen, entropy = TargetLogprob.apply(logits.reshape(batch * length, vocab), targets.reshape(-1), temperature,
                                          CHUNK_ELEMENTS, with_entropy)
    if entropy is not None:
        entropy = entropy.view(batch, length)[:, :-1]  # [B, T-1]
    return chosen.view(batch, length)[:, :-1], entropy  # [B, T-1]


class TargetLogprob(torch.autograd.Function):
    """(log-prob of each row's target, entropy of each row or None) of softmax(logits / temperature); the
    gradient flows to the logits through the log-prob only."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_elements: int = CHUNK_ELEMENTS,
                with_entropy: bool = True):
        # logits [N, V] (model dtype), targets [N] → chosen [N], entropy [N] or None, in the working dtype
        rows = logits.shape[0]
        chosen = torch.empty(rows, dtype=_working_dtype(logits), device=logits.device)  # [N]
        entropy = torch.empty_like(chosen) if with_entropy else None  # [N]
        normaliser = torch.empty_like(chosen)  # [N] logsumexp of the tempered logits
        for part in _row_chunks(logits, chunk_elements):
            scaled = logits[part].to(chosen.dtype) / temperature  # [n, V]
            lse = torch.logsumexp(scaled, dim=-1)  # [n]
            normaliser[part] = lse
            chosen[part] = scaled.gather(-1, targets[part].unsqueeze(-1)).squeeze(-1) - lse
            if entropy is not None:
                probs = torch.exp(scaled - lse.unsqueeze(-1))  # [n, V]
                entropy[part] = lse - (probs * scaled).sum(dim=-1)
        ctx.save_for_backward(logits, targets, normaliser)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_chosen: Tensor, _grad_entropy: Tensor):
        # d log p_target / d logit_j = (1[j = target] − p_j) / temperature, per row
        logits, targets, normaliser = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)  # [N, V]
        for part in _row_chunks(logits, ctx.chunk_elements):
            scaled = logits[part].to(normaliser.dtype) / ctx.temperature  # [n, V]
            probs = torch.exp(scaled - normaliser[part].unsqueeze(-1))  # [n, V]
            weight = grad_chosen[part].unsqueeze(-1)  # [n, 1]
            grad = -probs * weight  # [n, V]
            grad.scatter_add_(-1, targets[part].unsqueeze(-1), weight)
            grad_logits[part] = (grad / ctx.temperature).to(logits.dtype)
        return grad_logits, None, None, None, None


def _working_dtype(logits: Tensor) -> torch.dtype:
    """float32 for half-precision logits (bf16 cannot hold a log-normaliser precisely), float64 kept."""
    return torch.promote_types(logits.dtype, torch.float32)


def _row_chunks(logits: Tensor, chunk_elements: int) -> list[slice]:
    rows, vocab = logits.shape
    step = max(1, chunk_elements // max(vocab, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]
