"""Per-token log-probabilities (and entropies) of the target tokens under a causal LM."""

from __future__ import annotations

import torch
from torch import Tensor


def target_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """log π(token_{t+1} | tokens_≤t) and the entropy of π at t, both [B, T-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    logits = logits[:, :-1].float()  # [B, T-1, V] positions that predict a next token
    log_probs = torch.log_softmax(logits, dim=-1)  # [B, T-1, V]
    targets = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    chosen = log_probs.gather(-1, targets).squeeze(-1)  # [B, T-1]
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)  # [B, T-1]
    return chosen, entropy.detach()
