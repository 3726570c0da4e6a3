"""Exporting a learner checkpoint as a Hugging Face directory (safetensors, config, tokenizer) that
transformers and vLLM load; for a LoRA run, its adapter in PEFT's layout (which PEFT and vLLM's LoRA requests
load) and, on request, the base with the adapter merged in.

One plain process, no process group: `dcp.load` reads the sharded checkpoint straight into the state
dict of an unsharded model built from the run's `model.path`, whose config and tokenizer the export
keeps. The checkpoint stores the model under the top-level key "model" (see learner/policy/checkpoint.py), so
its entries are named `model.<parameter name>`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from peft import get_peft_model
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config.sections import LoraConfig
from learner.policy.checkpoint import META_FILE
from learner.policy.lora import ADAPTER_NAME, is_adapter_weight, peft_config
from learner.policy.policy_model import DTYPES

log = logging.getLogger(__name__)

MODEL_KEY = "model"  # the checkpoint's top-level entry holding the model weights
MERGED_DIR = "merged"  # under a LoRA export's directory: the base with the adapter merged in (--merged)


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold a weight the model needs (another model, or not a learner checkpoint)."""


def export_checkpoint(checkpoint: Path, model_path: str, dtype: str, out: Path, lora: LoraConfig | None = None,
                      merged: bool = False) -> Path:
    """Write the weights of `checkpoint` with the architecture, config and tokenizer of `model_path` to `out`. With
    `lora` enabled the checkpoint holds the adapter: `out` gets it in PEFT's layout, and with `merged` also
    `out/MERGED_DIR`, the base with the adapter merged in."""
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
    if lora is not None and lora.enabled:
        _export_adapter(base, checkpoint, model_path, lora, out, merged)
    else:
        load_trained_weights(base, checkpoint)
        _save(base, model_path, out)
    log.info("exported %s (step %d) to %s", checkpoint, checkpoint_step(checkpoint), out)
    return out


def _export_adapter(base: torch.nn.Module, checkpoint: Path, model_path: str, lora: LoraConfig, out: Path,
                    merged: bool) -> None:
    """PEFT builds the same adapted model as the learner (its inner model's parameter names are the learner's),
    reads the adapter from the checkpoint, and writes its own layout; the adapter keeps the base's dtype."""
    adapted = get_peft_model(base, peft_config(lora), adapter_name=ADAPTER_NAME, autocast_adapter_dtype=False)
    load_trained_weights(adapted.base_model.model, checkpoint, trained=is_adapter_weight)
    _save(adapted, model_path, out)
    if merged:
        _save(adapted.merge_and_unload(), model_path, out / MERGED_DIR)


def _save(model: torch.nn.Module, model_path: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)  # a tied output head is stored once, as HF expects
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)


def checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step (policy version) a complete checkpoint was taken at."""
    return int(json.loads((checkpoint / META_FILE).read_text())["step"])


def load_trained_weights(model: torch.nn.Module, checkpoint: Path, trained: Callable[[str], bool] = lambda name: True) -> None:
    """Overwrite `model`'s weights in place with the checkpoint's. Every weight named `trained` (all by default; with
    LoRA the adapter's, the base staying as loaded) must be in it. A tied weight the checkpoint stores under
    one name only (e.g. lm_head.weight shares embed_tokens.weight) is filled through its partner."""
    stored = set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    weights = model.state_dict()  # tied weights appear under every name, sharing one tensor
    wanted = {name: tensor for name, tensor in weights.items() if f"{MODEL_KEY}.{name}" in stored}
    _require_covered({name: tensor for name, tensor in weights.items() if trained(name)}, wanted, checkpoint)
    dcp.load({MODEL_KEY: wanted}, checkpoint_id=str(checkpoint), no_dist=True)  # copies into the model's tensors


def _require_covered(weights: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Every weight in `weights` is either read from the checkpoint or shares its storage with one that is."""
    loaded_storage = {tensor.data_ptr() for tensor in wanted.values()}
    missing = sorted(name for name, tensor in weights.items() if name not in wanted and tensor.data_ptr() not in loaded_storage)
    if missing:
        raise CheckpointMismatch(f"{checkpoint} has no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}: "
                                 "is it a learner checkpoint of this run's model.path and model.lora?")
