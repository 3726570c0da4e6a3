"""The policy half of the synchronous reference (`learner.mode=synchronous`, `launch.reference_loop`): the model,
its optimizer and one learner step per batch (`algorithm.mini_batches` × `algorithm.epochs` optimizer steps, the
async learner's `train_step`), with the learner's own model loading and loss.

One rank, no buffer, no weight broadcast: the caller hands in a batch and takes the new weights back."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from asyncrl.config import AsyncRLConfig
from asyncrl.messages import TrajectoryGroup
from asyncrl.net import LOOPBACK, free_port
from learner.batching import collate
from learner.distributed import World, init_world
from learner.loop import canonical_order
from learner.lr_schedule import learning_rate, set_learning_rate
from learner.main import plan_passes
from learner.policy_model import DTYPES, full_weights, load_policy, load_reference
from learner.train_step import Passes, StepOutcome, train_step


@dataclasses.dataclass
class ReferenceTrainer:
    config: AsyncRLConfig
    world: World  # a world of one rank: FSDP2 wraps the policy exactly as the async learner's rank 0 does
    model: torch.nn.Module
    reference: torch.nn.Module | None  # frozen model of algorithm.use_reference
    optimizer: torch.optim.Optimizer
    passes: Passes
    pad_id: int

    @classmethod
    def load(cls, config: AsyncRLConfig, world: World) -> ReferenceTrainer:
        """The policy at `model.path` (policy version 0) and a fresh AdamW in `world` (`open_world`), set up as the
        async learner sets up its rank: same seed, threads, sharding and micro-batches, so the two compute the
        same step."""
        if config.learner.torch_threads:
            torch.set_num_threads(config.learner.torch_threads)
        torch.manual_seed(config.run.seed)
        settings = config.learner
        model = load_policy(config.model.path, settings.master_dtype, settings, world)
        reference = load_reference(config, world)
        passes = plan_passes(config, model, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(settings.beta1, settings.beta2),
                                      weight_decay=settings.weight_decay)
        pad_id = AutoTokenizer.from_pretrained(config.model.path).pad_token_id or 0
        return cls(config, world, model, reference, optimizer, passes, pad_id)

    def train(self, groups: list[TrajectoryGroup], version: int) -> StepOutcome:
        """One learner step on `groups`, taking the policy from `version` to `version` + 1 (skipped, and
        `finite` False, when the loss or gradient is not finite). The rows go in content order, as the
        async learner orders them, so that the same samples make the same micro-batches and float sums."""
        rate = learning_rate(version, self.config.learner)
        set_learning_rate(self.optimizer, rate)
        batch = collate(canonical_order(groups), self.pad_id)
        outcome = train_step(self.model, self.optimizer, batch, self.config.algorithm, self.passes,
                             self.config.learner.grad_clip, self.world, self.reference)
        outcome.metrics["actor/lr"] = rate
        return outcome

    def weights(self, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """The full weights in `model.dtype` (the engine's) on `device`: a copy the engine loads from."""
        return full_weights(self.model, DTYPES[self.config.model.dtype], device, keep=True)


def open_world(config: AsyncRLConfig) -> World:
    """A world of one rank on a free port (a fixed default port would collide with another job on the host), on
    the first visible GPU or the CPU (`learner.device`)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()))
    return init_world(config.learner.device)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
