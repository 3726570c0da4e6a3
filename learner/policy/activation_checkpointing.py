"""Activation checkpointing of the decoder layers, chosen by `learner.activation_checkpointing`:

- none: every activation is kept for backward (fastest, memory grows with the micro-batch's tokens);
- selective: matrix products and attention keep their outputs; the cheap elementwise work between them
  (norms, rotary embeddings, activation functions, residual adds) is recomputed in backward, so its
  intermediates are not kept;
- full: only each layer's input is kept and the whole layer runs again in backward (least memory, about a
  third more compute);
- auto: the cheapest of those three that fits the learner's part of the GPU, chosen by `learner.policy.memory` once
  it has measured the model (none on CPU). Each layer then reads its mode from a `CheckpointingSwitch` at every
  call, so the probe passes can try one mode after another on the model as it will train.

Each layer's `forward` is wrapped in place (no wrapper module), so parameter and checkpoint names stay
the model's own.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

NONE, SELECTIVE, FULL, AUTO = "none", "selective", "full", "auto"
MODES = (NONE, SELECTIVE, FULL)  # cheapest first: each recomputes more and keeps less than the one before
_SWITCH_ATTRIBUTE = "asyncrl_checkpointing_switch"


class CheckpointingSwitch:
    """The mode that `auto`'s layers run in (one of MODES), read at every call; none until it is chosen."""

    def __init__(self) -> None:
        self.mode = NONE


def checkpointing_for_device(mode: str, device: torch.device) -> str:
    """`mode` as configured, except `auto` off a GPU: none (there is no device memory to save)."""
    return NONE if mode == AUTO and device.type != "cuda" else mode


def apply_activation_checkpointing(layers: list[torch.nn.Module], mode: str) -> CheckpointingSwitch | None:
    """Wrap each layer's forward for `mode` (one of MODES, or AUTO); `none` leaves them as they are. For AUTO,
    the switch the layers read their mode from (set it before training); None otherwise."""
    if mode == AUTO:
        switch = CheckpointingSwitch()
        for layer in layers:
            layer.forward = _switched(layer.forward, switch)
        return switch
    if mode not in MODES:
        raise ValueError(f"learner.activation_checkpointing: '{mode}' is not one of {[*MODES, AUTO]}")
    if mode != NONE:
        for layer in layers:
            layer.forward = _checkpointed(layer.forward, _context(mode))
    return None


def attach_switch(model: torch.nn.Module, switch: CheckpointingSwitch | None) -> None:
    """Keep `auto`'s switch on the model, where `learner.policy.memory` finds it (nothing for a fixed mode)."""
    if switch is not None:
        setattr(model, _SWITCH_ATTRIBUTE, switch)


def checkpointing_switch(model: torch.nn.Module) -> CheckpointingSwitch | None:
    """The switch of a model sharded with `auto` on a GPU, else None (its mode is fixed)."""
    return getattr(model, _SWITCH_ATTRIBUTE, None)


def checkpointing_mode(model: torch.nn.Module, configured: str, device: torch.device) -> str:
    """The mode the model's decoder layers run in (one of MODES): `auto`'s choice where the memory plan made one,
    else the configured mode as `device` takes it (auto off a GPU: none)."""
    switch = checkpointing_switch(model)
    return switch.mode if switch is not None else checkpointing_for_device(configured, device)


def _context(mode: str) -> Callable | None:
    return functools.partial(create_selective_checkpoint_contexts, _keep_products) if mode == SELECTIVE else None


def _switched(forward: Callable, switch: CheckpointingSwitch) -> Callable:
    """`forward` run as `switch.mode` says at each call (a compiled layer recompiles once per mode it meets)."""
    by_mode = {NONE: forward} | {mode: _checkpointed(forward, _context(mode)) for mode in (SELECTIVE, FULL)}

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return by_mode[switch.mode](*args, **kwargs)

    return run


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
