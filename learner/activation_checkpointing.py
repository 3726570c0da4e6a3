"""Activation checkpointing of the decoder layers, chosen by `learner.activation_checkpointing`:

- none: every activation is kept for backward (fastest, memory grows with the micro-batch's tokens);
- selective: matrix products and attention keep their outputs; the cheap elementwise work between them
  (norms, rotary embeddings, activation functions, residual adds) is recomputed in backward, so its
  intermediates are not kept;
- full: only each layer's input is kept and the whole layer runs again in backward (least memory, about a
  third more compute).

Each layer's `forward` is wrapped in place (no wrapper module), so parameter and checkpoint names stay
the model's own.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

NONE, SELECTIVE, FULL = "none", "selective", "full"
MODES = (NONE, SELECTIVE, FULL)


def apply_activation_checkpointing(layers: list[torch.nn.Module], mode: str) -> None:
    """Wrap each layer's forward for `mode` (one of MODES); `none` leaves them as they are."""
    if mode == NONE:
        return
    if mode not in MODES:
        raise ValueError(f"learner.activation_checkpointing: '{mode}' is not one of {list(MODES)}")
    context = functools.partial(create_selective_checkpoint_contexts, _keep_products) if mode == SELECTIVE else None
    for layer in layers:
        layer.forward = _checkpointed(layer.forward, context)


def _checkpointed(forward: Callable, context: Callable | None) -> Callable:
    options = {"use_reentrant": False} | ({"context_fn": context} if context is not None else {})

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, **options, **kwargs)

    return run


def _kept_ops() -> frozenset:
    """aten's matrix products and the attention kernels this learner runs (those present in this torch)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
             "_cudnn_attention_forward")
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    try:
        importlib.import_module("torch.nn.attention.varlen")  # registers torch_attn::_varlen_attn
        ops.add(torch.ops.torch_attn._varlen_attn.default)
    except (ImportError, AttributeError):
        pass
    return frozenset(ops)


KEPT_OPS = _kept_ops()


def _keep_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE
