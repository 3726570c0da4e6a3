"""This rank's policy and optimizer, and what the learner does with them: one optimizer step per batch, a checkpoint
saved, a checkpoint restored. Each of these is a collective: every rank calls it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from asyncrl.config import AsyncRLConfig
from asyncrl.messages import TrajectoryGroup
from asyncrl.learner_plan import LearnerPlan
from asyncrl.memory_plan import GpuSplit
from asyncrl.placement import servers_on_learner_gpu
from learner.distributed import World
from learner.maths.batching import collate
from learner.maths.logprobs import sampling_temperature
from learner.maths.lr_schedule import set_learning_rate
from learner.policy.activation_checkpointing import checkpointing_mode
from learner.policy.checkpoint import load_checkpoint, save_checkpoint
from learner.policy.memory import hold_to_part, peak_memory_metrics, resolve_micro_batch_tokens
from learner.policy.policy_model import load_policy, load_reference, weights_held_for_servers
from learner.policy.train_step import Passes, StepOutcome, train_step

log = logging.getLogger(__name__)


@dataclass
class PolicyTrainer:
    config: AsyncRLConfig
    world: World
    model: torch.nn.Module  # the policy, sharded over the ranks (FSDP2)
    reference: torch.nn.Module | None  # frozen model of algorithm.use_reference
    optimizer: torch.optim.Optimizer
    passes: Passes  # how each batch goes through the model
    pad_id: int

    @classmethod
    def load(cls, config: AsyncRLConfig, world: World) -> PolicyTrainer:
        """The policy at `model.path` (with `model.lora`'s adapters) and a fresh AdamW over what trains, seeded and
        threaded as `learner.*` says (a checkpoint restores them after)."""
        settings = config.learner
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        torch.manual_seed(config.run.seed)
        split = hold_to_part(world, config.run.gpu_memory_gib, *servers_on_learner_gpu(config))  # before any allocation
        loading = time.perf_counter()
        model = load_policy(config.model.path, settings.master_dtype, settings, world, config.model.lora)
        reference = load_reference(config, world, model)  # before sizing the micro-batches: its weights take memory too
        planning = time.perf_counter()
        passes = plan_passes(config, model, world, split)  # before the optimizer state exists: the plan leaves it room
        log.info("weights loaded and sharded in %.1fs, the passes planned in %.1fs", planning - loading,
                 time.perf_counter() - planning)
        trained = [parameter for parameter in model.parameters() if parameter.requires_grad]  # with LoRA: the adapters
        optimizer = torch.optim.AdamW(trained, lr=settings.lr, betas=(settings.beta1, settings.beta2),
                                      weight_decay=settings.weight_decay)
        pad_id = AutoTokenizer.from_pretrained(config.model.path).pad_token_id or 0
        return cls(config, world, model, reference, optimizer, passes, pad_id)

    def train(self, groups: list[TrajectoryGroup], rate: float) -> StepOutcome:
        """One optimizer step on `groups` at learning rate `rate` (skipped, `finite` False, when the loss or
        gradient is not finite)."""
        set_learning_rate(self.optimizer, rate)
        batch = collate(canonical_order(groups), self.pad_id)
        algorithm = self.config.algorithm.resolved(self.config.rollout.sampling.max_tokens)
        outcome = train_step(self.model, self.optimizer, batch, algorithm, self.passes,
                             self.config.learner.grad_clip, self.world, self.reference)
        outcome.metrics |= peak_memory_metrics(self.world)
        return outcome

    def plan(self) -> LearnerPlan:
        """The passes as this rank runs them, `auto` settings resolved: what `asyncrl tune` reads
        (`asyncrl.learner_plan`)."""
        checkpointing = checkpointing_mode(self.model, self.config.learner.activation_checkpointing, self.world.device)
        return LearnerPlan(self.passes.micro_batch_tokens, self.passes.packed, checkpointing)

    def save(self, root: Path, step: int, meta: dict[str, Any]) -> Path:
        """Checkpoint `step` under `root` with `meta` (rank 0's is written), keeping learner.keep_checkpoints."""
        return save_checkpoint(root, step, self.model, self.optimizer, meta, self.world, self.config.learner.keep_checkpoints)

    def restore(self, checkpoint: Path) -> dict[str, Any]:
        """Back to `checkpoint`'s weights, optimizer state and RNG; returns its metadata."""
        return load_checkpoint(checkpoint, self.model, self.optimizer, self.world)


def canonical_order(groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """The batch's groups sorted by content, not by arrival: the same samples give the same micro-batches
    and float sums whatever order concurrent requests finished in (K=0 then reproduces the synchronous reference)."""
    return sorted(groups, key=lambda group: [(t.prompt_ids, t.completion_ids) for t in group.trajectories])


def plan_passes(config: AsyncRLConfig, model: torch.nn.Module, world: World, split: GpuSplit | None) -> Passes:
    """Micro-batch size (planned in this rank's part of the GPU, `split`, when auto), packing, and the servers'
    sampling temperature; every rank calls."""
    packed = config.learner.packs(world.device.type == "cuda")
    held = weights_held_for_servers(config, model, world, split.servers if split else 0)
    tokens = resolve_micro_batch_tokens(model, config.learner, world, model.config.vocab_size,
                                        model.config.max_position_embeddings, packed, split, held)
    log.info("micro-batches of %d tokens, %s", tokens, "packed" if packed else "padded")
    return Passes(micro_batch_tokens=tokens, packed=packed, temperature=sampling_temperature(config.rollout))
