"""The learning rate of each optimizer step: linear warm-up over `learner.warmup_steps`, then constant or a
cosine decay to `learner.min_lr_ratio` · `learner.lr` at `learner.total_steps` (the last step run is one
before). A pure function of the step, so a resumed run continues the schedule from its checkpoint's step
with no scheduler state to save."""

from __future__ import annotations

import math

import torch

from asyncrl.config.learner import LearnerConfig

CONSTANT, COSINE = "constant", "cosine"


def learning_rate(step: int, settings: LearnerConfig) -> float:
    """The rate of the optimizer step that takes the policy from version `step` to `step` + 1."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    if settings.lr_schedule == CONSTANT:
        return settings.lr
    decay_steps = max(settings.total_steps - settings.warmup_steps, 1)
    progress = min((step - settings.warmup_steps) / decay_steps, 1.0)
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_learning_rate(optimizer: torch.optim.Optimizer, rate: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = rate
