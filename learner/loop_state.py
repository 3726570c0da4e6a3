"""Where the learner's loop stands: the policy version, the buffer position, the learning-rate factor, K, and
what a checkpoint restores of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import AsyncRLConfig
from asyncrl.messages import Batch
from learner.distributed import World
from learner.policy.checkpoint import CHECKPOINTS_DIR, latest_checkpoint, load_checkpoint


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done = policy version
    buffer_offset: int = -1  # buffer log position after the last trained batch (-1 = the buffer's commit)
    buffer_ahead: list[int] = field(default_factory=list)  # records at or past buffer_offset trained (or dropped) too
    bad_steps: int = 0  # consecutive skipped steps
    # the task-weight scheduler's state as resumed, or as a rollback restored it (rank 0's scheduler holds the current one)
    task_weights: dict[str, Any] = field(default_factory=dict)
    lr_scale: float = 1.0  # factor on the scheduled learning rate (guard.lr_scale at each rollback)
    guard: dict[str, Any] = field(default_factory=dict)  # the safety guard's state in the checkpoint resumed from
    max_staleness: int = 0  # K rank 0 takes the next batch under (changes during the run with buffer.max_staleness=auto)

    def trained(self, batch: Batch) -> None:
        """An optimizer step on `batch` is done: the next version, and the buffer position past the batch."""
        self.bad_steps = 0
        self.step += 1
        self.buffer_offset, self.buffer_ahead = batch.next_offset, batch.next_ahead

    def checkpoint_meta(self) -> dict[str, Any]:
        """The loop's part of a checkpoint's metadata (`resume_state` reads it back)."""
        return {"buffer_offset": self.buffer_offset, "buffer_ahead": self.buffer_ahead, "lr_scale": self.lr_scale,
                "max_staleness": self.max_staleness}


def resume_state(config: AsyncRLConfig, run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 world: World) -> LoopState:
    """Where training continues: a checkpoint named by learner.resume, the latest one (auto), or scratch."""
    choice, starting_k = config.learner.resume, config.buffer.starting_staleness()
    if choice == "never":
        return LoopState(max_staleness=starting_k)
    path = latest_checkpoint(run_dir / CHECKPOINTS_DIR) if choice == "auto" else Path(choice)
    if path is None:
        return LoopState(max_staleness=starting_k)
    meta = load_checkpoint(path, model, optimizer, world)
    paced_k = meta.get("max_staleness", starting_k) if config.buffer.paced else starting_k  # a fixed K is the config's
    return LoopState(step=meta["step"], buffer_offset=meta["buffer_offset"], buffer_ahead=meta.get("buffer_ahead", []),
                     task_weights=meta.get("task_weights", {}), lr_scale=meta.get("lr_scale", 1.0), guard=meta.get("guard", {}),
                     max_staleness=paced_k)
