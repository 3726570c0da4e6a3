"""The policy half of the synchronous reference (`learner.mode=synchronous`, `launch.reference_loop`): the model,
its optimizer and one learner step per batch (`algorithm.mini_batches` × `algorithm.epochs` optimizer steps, the
async learner's `train_step`), with the learner's own model loading and loss.

No buffer, no weight broadcast: the caller hands in a batch and takes the new weights back. With `learner.nproc` > 1
this is one FSDP2 rank of the policy (colocated: each rank beside its own engine); the ranks pool the groups they
sampled (`gathered`), and every rank trains on the whole batch as the async learner's ranks do, each on its share of
its rows, the loss normalised over the whole batch."""

from __future__ import annotations

import dataclasses

import torch

from asyncrl.config import AsyncRLConfig
from asyncrl.messages import TrajectoryGroup
from learner.distributed import World, all_gather_bytes
from learner.maths.lr_schedule import learning_rate
from learner.policy.policy_model import DTYPES, full_weights
from learner.policy.policy_trainer import PolicyTrainer
from learner.policy.train_step import StepOutcome


@dataclasses.dataclass
class ReferenceTrainer:
    policy: PolicyTrainer  # this rank's: FSDP2 wraps the policy exactly as the async learner's rank does

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that validates and records."""
        return self.policy.world.is_main

    @classmethod
    def load(cls, config: AsyncRLConfig, world: World) -> ReferenceTrainer:
        """The policy at `model.path` (policy version 0) and a fresh AdamW in `world` (`learner.main.learner_world`),
        set up as the async learner sets up its rank: same seed, threads, sharding and micro-batches, so the two
        compute the same step."""
        return cls(PolicyTrainer.load(config, world))

    def train(self, groups: list[TrajectoryGroup], version: int) -> StepOutcome:
        """One learner step on `groups`, taking the policy from `version` to `version` + 1 (skipped, and
        `finite` False, when the loss or gradient is not finite). The rows go in content order, as the
        async learner orders them, so that the same samples make the same micro-batches and float sums."""
        rate = learning_rate(version, self.policy.config.learner)
        outcome = self.policy.train(groups, rate)
        outcome.metrics["actor/lr"] = rate
        return outcome

    def gathered(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload` in rank order, on every rank (a collective; one rank: [`payload`])."""
        return all_gather_bytes(payload, self.policy.world)

    def weights(self, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """The full served weights (with LoRA the adapter) in `model.dtype` (the engine's) on `device`: a copy the
        engine loads from, on every rank (gathering them is a collective)."""
        return full_weights(self.policy.model, DTYPES[self.policy.config.model.dtype], device, keep=True)
