"""Loading the policy as an FSDP2-sharded module, and gathering its full weights back."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

from asyncrl.config.learner import LearnerConfig
from learner.distributed import World

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(model_path: str, dtype: str, settings: LearnerConfig, world: World) -> torch.nn.Module:
    """The HF causal LM at `model_path`, sharded with fully_shard per decoder layer and at the root."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype], attn_implementation=attention_backend())
    return shard_policy(model, settings, world)


def shard_policy(model: torch.nn.Module, settings: LearnerConfig, world: World) -> torch.nn.Module:
    """`model` on this rank's device, sharded with fully_shard per decoder layer and at the root."""
    model.to(world.device)
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    policy = _mixed_precision(settings, world)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights on every rank's CPU (tied output heads included under their own name)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected decoder layers at model.model.layers to shard")
    return list(layers)


def _mixed_precision(settings: LearnerConfig, world: World) -> MixedPrecisionPolicy:
    if settings.mixed_precision and world.device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def attention_backend() -> str:
    """flash-attn when installed (GPU extra), else PyTorch's sdpa."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash_attention_2"
