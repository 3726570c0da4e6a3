"""Exporting a learner checkpoint as a Hugging Face directory (safetensors, config, tokenizer) that
transformers and vLLM load.

One plain process, no process group: `dcp.load` reads the sharded checkpoint straight into the state
dict of an unsharded model built from the run's `model.path`, whose config and tokenizer the export
keeps. The checkpoint stores the model under the top-level key "model" (see learner/checkpoint.py), so
its entries are named `model.<parameter name>`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.checkpoint import META_FILE
from learner.policy_model import DTYPES

log = logging.getLogger(__name__)

MODEL_KEY = "model"  # the checkpoint's top-level entry holding the model weights


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold a weight the model needs (another model, or not a learner checkpoint)."""


def export_checkpoint(checkpoint: Path, model_path: str, dtype: str, out: Path) -> Path:
    """Write the weights of `checkpoint` with the architecture, config and tokenizer of `model_path` to `out`."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
    load_trained_weights(model, checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)  # a tied output head is stored once, as HF expects
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    log.info("exported %s (step %d) to %s", checkpoint, checkpoint_step(checkpoint), out)
    return out


def checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step (policy version) a complete checkpoint was taken at."""
    return int(json.loads((checkpoint / META_FILE).read_text())["step"])


def load_trained_weights(model: torch.nn.Module, checkpoint: Path) -> None:
    """Overwrite `model`'s weights in place with the checkpoint's. A tied weight the checkpoint stores under
    one name only (e.g. lm_head.weight shares embed_tokens.weight) is filled through its partner."""
    stored = set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    weights = model.state_dict()  # tied weights appear under every name, sharing one tensor
    wanted = {name: tensor for name, tensor in weights.items() if f"{MODEL_KEY}.{name}" in stored}
    _require_covered(weights, wanted, checkpoint)
    dcp.load({MODEL_KEY: wanted}, checkpoint_id=str(checkpoint), no_dist=True)  # copies into the model's tensors


def _require_covered(weights: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Every weight is either read from the checkpoint or shares its storage with one that is."""
    loaded_storage = {tensor.data_ptr() for tensor in wanted.values()}
    missing = sorted(name for name, tensor in weights.items() if name not in wanted and tensor.data_ptr() not in loaded_storage)
    if missing:
        raise CheckpointMismatch(f"{checkpoint} has no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}: "
                                 "is it a learner checkpoint of this run's model.path?")
