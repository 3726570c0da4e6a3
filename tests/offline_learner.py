"""The learner's loop for tests that run no buffer and no rollout server: rank 0's real services over
`OfflineConnections`, which stand in for its connections (`learner.services.connections.LearnerConnections`): the batches come
from a script, and what rank 0 would send out is kept for the test to read."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from asyncrl.config import AsyncRLConfig
from asyncrl.messages import Batch
from learner.distributed import World
from learner.loop import run_loop
from learner.loop_state import LoopState
from learner.policy.policy_trainer import PolicyTrainer
from learner.policy.train_step import Passes
from learner.services.rank_services import RankZeroServices
from learner.weight_sync.coordinator import RoundReport


class OfflineConnections:
    def __init__(self, fetch_batch: Callable[[int, int], Batch]) -> None:
        self.fetch_batch = fetch_batch  # (version, max_staleness) -> the next batch
        self.rounds: list[tuple[int, float]] = []  # each weight round: (version sent, sum of the weights sent)
        self.published: list[int] = []  # versions told to the buffer
        self.records: list[tuple[int, dict[str, float]]] = []  # each logged step: (version, its record)
        self.commits: list[tuple[int, int, list[int]]] = []  # (version, buffer offset, records ahead) of each commit
        self.finished_at: int | None = None

    @property
    def logged(self) -> dict[int, dict[str, float]]:
        """The last record logged for each version."""
        return dict(self.records)

    def wait_for_servers(self) -> None:
        pass

    def sync_weights(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> RoundReport:
        self.rounds.append((version, sum(tensor.double().sum().item() for _, tensor in weights)))
        return RoundReport(version, servers=0)

    def release_weights(self) -> None:
        pass

    def publish_version(self, version: int) -> None:
        self.published.append(version)

    def new_validations(self) -> list[dict[str, float]]:
        return []

    def final_validation(self, version: int) -> list[dict[str, float]]:
        return []

    def server_metrics(self, version: int) -> dict[str, float]:
        return {}

    def log_metrics(self, version: int, metrics: dict[str, float]) -> None:
        self.records.append((version, dict(metrics)))

    def commit(self, version: int, buffer_offset: int, buffer_ahead: list[int]) -> None:
        self.commits.append((version, buffer_offset, list(buffer_ahead)))

    def finish(self, version: int) -> None:
        self.finished_at = version

    def close(self) -> None:
        pass


def run_offline(config: AsyncRLConfig, run_dir: Path, world: World, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, state: LoopState, connections: OfflineConnections,
                reference: torch.nn.Module | None = None) -> LoopState:
    """The learner's loop on this one rank (`world`), rank 0's services over `connections`."""
    trainer = PolicyTrainer(config, world, model, reference, optimizer, Passes(4096), pad_id=0)
    services = RankZeroServices.build(connections, config, run_dir, world, model, state)
    return run_loop(config, run_dir, state, trainer, services)
