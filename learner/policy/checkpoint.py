"""Checkpoints with torch.distributed.checkpoint: sharded model and optimizer state plus the run's
position (step, data position, the buffer offset to commit, RNG) in one directory per step.

Atomicity: every rank writes into `step_N.partial/`; after a barrier rank 0 writes `meta.json` and
renames the directory to `step_N/`. A directory without that final name is never resumed from, so a
run killed mid-save resumes from the previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from learner.distributed import World
from asyncrl.rng import rng_state_from_json, rng_state_to_json

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"  # under the run directory
META_FILE = "meta.json"
_PREFIX = "step_"
_PARTIAL = ".partial"
# Restoring leaves weights the checkpoint does not hold (LoRA's frozen base) as loaded; `dcp.load` still fails on a
# trained weight the checkpoint lacks.
_NOT_STRICT = StateDictOptions(strict=False)


def save_checkpoint(
    root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any], world: World, keep: int
) -> Path:
    """Write checkpoint `step` under `root` and prune to the newest `keep`; returns its directory."""
    final = root / f"{_PREFIX}{step:08d}"
    partial = final.with_name(final.name + _PARTIAL)
    if world.is_main:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    dcp.save(_trained_state(model, optimizer), checkpoint_id=str(partial))
    (partial / _rank_rng_file(world.rank)).write_text(json.dumps(_rank_rng(world)))
    dist.barrier()
    if world.is_main:
        record = {"step": step, "python_rng": rng_state_to_json(random.getstate()), "torch_rng": torch.get_rng_state().tolist()}
        (partial / META_FILE).write_text(json.dumps(record | meta))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        _prune(root, keep)
        log.info("checkpoint saved: %s", final)
    dist.barrier()
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, if any."""
    return max(_complete(root), key=lambda p: p.name, default=None)


def checkpoint_at_or_before(root: Path, step: int) -> Path | None:
    """The newest complete checkpoint under `root` of step `step` or earlier, if any."""
    return max((p for p in _complete(root) if int(p.name[len(_PREFIX):]) <= step), key=lambda p: p.name, default=None)


def remove_checkpoints_after(root: Path, step: int) -> list[Path]:
    """Delete the complete checkpoints under `root` newer than `step` (a rolled-back branch); returns them."""
    newer = [p for p in _complete(root) if int(p.name[len(_PREFIX):]) > step]
    for path in newer:
        shutil.rmtree(path)
    return newer


def _complete(root: Path) -> list[Path]:
    return [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and not p.name.endswith(_PARTIAL) and (p / META_FILE).is_file()]


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World) -> dict[str, Any]:
    """Restore model, optimizer and RNG state in place (this rank's CPU and CUDA generators where the checkpoint
    holds them); returns the metadata (step, data, buffer offset)."""
    state = _trained_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_NOT_STRICT)
    meta = json.loads((path / META_FILE).read_text())
    random.setstate(rng_state_from_json(meta["python_rng"]))
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    _restore_rank_rng(path / _rank_rng_file(world.rank), world)
    log.info("resumed from %s (step %d)", path, meta["step"])
    return meta


def _trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint holds: the weights that train and the optimizer state. With LoRA, the adapters: the frozen
    base (a tied output head included, which torch's own `ignore_frozen_params` keeps) comes from model.path again;
    else every weight."""
    model_state, optim_state = get_state_dict(model, optimizer)
    trained = {name for name, tensor in model.state_dict(keep_vars=True).items() if tensor.requires_grad}
    return {"model": {name: value for name, value in model_state.items() if name in trained}, "optim": optim_state}


def _rank_rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.json"


def _rank_rng(world: World) -> dict[str, Any]:
    """This rank's torch generators: the CPU one, and its GPU's (each rank draws on its own device)."""
    cuda = torch.cuda.get_rng_state(world.device).tolist() if world.device.type == "cuda" else None
    return {"torch_rng": torch.get_rng_state().tolist(), "cuda_rng": cuda}


def _restore_rank_rng(file: Path, world: World) -> None:
    if not file.is_file():  # a checkpoint written before ranks saved their own generators
        return
    state = json.loads(file.read_text())
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
    if state["cuda_rng"] is not None and world.device.type == "cuda":
        torch.cuda.set_rng_state(torch.tensor(state["cuda_rng"], dtype=torch.uint8), world.device)


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob(f"{_PREFIX}*") if not p.name.endswith(_PARTIAL))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)

