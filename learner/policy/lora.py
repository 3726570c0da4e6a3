"""LoRA adapters on the policy (`model.lora`).

PEFT's LoRA layers are injected into the Hugging Face model itself (`peft.inject_adapter_in_model`), before it is
sharded: the model keeps its class, so the fused scoring head, the decoder layers that FSDP2 wraps and the model's
config work as without adapters, and the adapters shard with their layers. Only the adapters train; the base
stays frozen. Here too: the adapters' names in PEFT's file layout (what the servers and `asyncrl export` write),
the base with the adapters switched off as the reference of the KL term, and the adapters' dropout.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer

from asyncrl.config.loader import ConfigError
from asyncrl.config.sections import LoraConfig
from learner.maths.logprobs import SCORING_METHOD

ADAPTER_NAME = "default"  # PEFT's name of the one adapter; part of every adapter parameter's name
PEFT_FILE_PREFIX = "base_model.model."  # what PEFT's adapter files put before the model's own parameter names
_ADAPTER_MATRICES = (".lora_A.", ".lora_B.")


def peft_config(lora: LoraConfig) -> PeftLoraConfig:
    """`model.lora` as PEFT's config of a causal LM's adapter."""
    return PeftLoraConfig(task_type="CAUSAL_LM", **lora.peft_fields())


def add_adapters(model: torch.nn.Module, decoder_layers: list[torch.nn.Module], lora: LoraConfig,
                 dtype: torch.dtype) -> torch.nn.Module:
    """Inject `lora`'s adapters into `model`'s decoder layers, in `dtype`, and freeze everything else. PEFT starts
    B at zero, so the policy starts as the base. Their dropout stays off but in training passes (`adapter_dropout`).
    Raises `ConfigError` naming the key when `lora` does not fit."""
    check_targets(model, decoder_layers, lora)
    inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER_NAME)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for layer in lora_layers(model):
        for matrices in (layer.lora_A, layer.lora_B):
            matrices[ADAPTER_NAME].to(dtype).requires_grad_(True)
        layer.lora_dropout.eval()  # new modules start in training mode, whatever mode the model is in
    return model


def check_targets(model: torch.nn.Module, decoder_layers: list[torch.nn.Module], lora: LoraConfig) -> None:
    """Every target names linear layers of the decoder layers (the layers vLLM serves adapters for), and the rank
    is at most the smaller side of each of them (a larger one adds parameters, not expressiveness)."""
    linear = {name: module for layer in decoder_layers for name, module in layer.named_modules()
              if isinstance(module, torch.nn.Linear)}  # name within its decoder layer -> layer
    by_target = {target: [m for name, m in linear.items() if name.rsplit(".", 1)[-1] == target]
                 for target in lora.target_modules}
    missing = [target for target, found in by_target.items() if not found]
    if missing:
        names = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ConfigError(f"model.lora.target_modules: {missing} name no linear layer of {type(model).__name__}'s "
                          f"decoder layers (they have {names})")
    target, narrowest = min(((target, m) for target, found in by_target.items() for m in found),
                            key=lambda item: min(item[1].in_features, item[1].out_features))
    side = min(narrowest.in_features, narrowest.out_features)
    if lora.rank > side:
        raise ConfigError(f"model.lora.rank: {lora.rank} exceeds {side}, the smaller side of the '{target}' layers "
                          f"({narrowest.in_features} -> {narrowest.out_features}) of {type(model).__name__}")


def lora_layers(model: torch.nn.Module) -> list[LoraLayer]:
    """The layers that carry adapters (none in a model trained whole)."""
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def has_adapters(model: torch.nn.Module) -> bool:
    return any(isinstance(module, LoraLayer) for module in model.modules())


def has_adapter_dropout(model: torch.nn.Module) -> bool:
    """Whether the adapters drop inputs in training passes (`model.lora.dropout` > 0): such a pass is not the policy
    that scores π_prox and samples."""
    return any(isinstance(module, torch.nn.Dropout) and module.p > 0
               for layer in lora_layers(model) for module in layer.lora_dropout.modules())


def is_adapter_weight(name: str) -> bool:
    """Whether a parameter name (the learner's, with PEFT's adapter name in it) is an adapter matrix."""
    return any(part in name for part in _ADAPTER_MATRICES)


def file_name(name: str) -> str:
    """An adapter parameter's name in PEFT's adapter files, which vLLM reads: `model.layers.0.self_attn.q_proj.
    lora_A.default.weight` -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return PEFT_FILE_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapters' live tensors (sharded where the model is) under their names in PEFT's files, in state-dict
    order."""
    return [(file_name(name), tensor) for name, tensor in model.state_dict(keep_vars=True).items()
            if is_adapter_weight(name)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Inside, the model computes as its base alone (PEFT's own switch on each adapted layer)."""
    layers = lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # PEFT makes the adapter trainable again as it switches it on


@contextlib.contextmanager
def adapter_dropout(model: torch.nn.Module) -> Iterator[None]:
    """The adapters' dropout active inside (the training passes). The learner's model is otherwise in eval mode,
    so π_prox, the reference and the servers, which sample without dropout, see none. No-op without adapters."""
    dropouts = [layer.lora_dropout for layer in lora_layers(model)]
    for dropout in dropouts:
        dropout.train()
    try:
        yield
    finally:
        for dropout in dropouts:
            dropout.eval()


class AdaptersOff(torch.nn.Module):
    """The policy scored with its adapters switched off: the frozen base, i.e. the reference model of the KL term
    when `algorithm.reference_path` is empty, held once (no second copy of the weights)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def score_targets(self, *args, **kwargs):
        """The policy's `SCORING_METHOD` (`learner.maths.logprobs` scores through it) with the adapters off."""
        with adapters_disabled(self.policy):
            return getattr(self.policy, SCORING_METHOD)(*args, **kwargs)

