"""What a learner rank does beside training, behind the one interface the loop calls on every rank.

Rank 0 (`RankZeroServices`) is the learner's side facing the job: it takes each batch from the buffer and
hands it to the other ranks, sends the weights to the rollout servers, publishes each version, keeps the
pacing controller, the task weights and the safety guard, logs the step's record and commits the buffer
position a checkpoint holds. The other ranks (`PeerServices`) take their part in the same collectives (the
batch, the weight gather, the guard's decision) and talk to nothing outside the learner."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

import torch

from asyncrl.config import AsyncRLConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.messages import Batch, decode, encode
from learner.distributed import World, broadcast_bytes
from learner.loop_state import LoopState
from learner.policy.checkpoint import CHECKPOINTS_DIR
from learner.services.connections import LearnerConnections
from learner.services.guard import Drained, GuardDecision, GuardFollower, NoGuard, RollBack, SafetyGuard
from learner.services.pacing import FixedStaleness, Pacer
from learner.services.snapshots import SnapshotWriter
from learner.services.task_weight_publisher import FixedTaskWeights, TaskWeightsPublisher
from learner.services.weight_sharing import WeightSharing

log = logging.getLogger(__name__)


class RankServices(Protocol):
    """Every method is called on every rank, in the same order (several are collectives)."""

    @property
    def max_staleness(self) -> int:
        """K the next batch is asked under."""

    def begin(self, version: int) -> None:
        """Before the first step: the servers get the weights of `version`."""

    def next_batch(self, version: int, max_staleness: int) -> Batch:
        """Rank 0's next batch for `version` under the bound `max_staleness`, on every rank."""

    def pace(self, version: int, metrics: Mapping[str, float]) -> int:
        """K for the steps after `version`, from its metrics."""

    def after_step(self, version: int, metrics: dict[str, float]) -> None:
        """Share the weights when due; rank 0 publishes `version` and logs the step's record."""

    def guard_decision(self) -> GuardDecision:
        """Rank 0's guard's decision after the step, on every rank."""

    def drain(self, rollback: RollBack, offset: int, ahead: list[int]) -> Drained:
        """Rank 0 consumes and discards what the collapsed policy was admitted to sample."""

    def rolled_back(self, rollback: RollBack, drained: Drained) -> int:
        """Once the checkpoint is restored; returns the samples trained since it (rank 0's count)."""

    def resume(self, version: int, task_weights: Mapping[str, Any]) -> None:
        """After a rollback: the restored weights and task weights go to the servers as `version`."""

    def checkpoint_meta(self) -> dict[str, Any]:
        """What rank 0's services keep in a checkpoint beside the loop's state."""

    def committed(self, version: int, buffer_offset: int, buffer_ahead: list[int]) -> None:
        """The checkpoint of `version`, holding this buffer position, is saved."""

    def finish(self, version: int) -> None:
        """The job ended at `version`."""


class RankZeroServices:
    """Rank 0's side: the learner's only link to the buffer, the rollout servers and the metrics sink."""

    def __init__(self, config: AsyncRLConfig, world: World, connections: LearnerConnections, sharing: WeightSharing,
                 tasks: TaskWeightsPublisher | FixedTaskWeights, guard: SafetyGuard | NoGuard,
                 pacer: Pacer | FixedStaleness) -> None:
        """`connections`: the buffer, the weight-sync coordinator and the metrics sink."""
        self.config, self.world, self.connections, self.sharing = config, world, connections, sharing
        self.tasks, self.guard, self.pacer = tasks, guard, pacer
        self.started = time.perf_counter()  # when training started: `begin` sets it again after the servers joined

    @classmethod
    def build(cls, connections: LearnerConnections, config: AsyncRLConfig, run_dir: Path, world: World,
              model: torch.nn.Module, resumed: LoopState) -> RankZeroServices:
        """Rank 0's services over `connections`, continuing from the checkpoint's task weights, guard and K."""
        tasks = (TaskWeightsPublisher.start(config, resumed.task_weights, connections.coordinator)
                 if config.data.task_weights.enabled else FixedTaskWeights(resumed.task_weights))
        guard = SafetyGuard.of_run(config, run_dir / CHECKPOINTS_DIR, resumed.guard) if config.guard.enabled else NoGuard()
        pacer = (Pacer(config.buffer.pacing, resumed.max_staleness) if config.buffer.paced
                 else FixedStaleness(resumed.max_staleness))
        snapshots = (SnapshotWriter(run_dir, config.validation.every, config.learner.total_steps)
                     if config.validation.after_run else None)
        return cls(config, world, connections, WeightSharing(config, model, world, connections, snapshots), tasks, guard,
                   pacer)

    @property
    def max_staleness(self) -> int:
        return self.pacer.k

    def begin(self, version: int) -> None:
        self.connections.wait_for_servers()  # the other ranks wait for rank 0 in the weight gather
        self.sharing(version)
        self.tasks.publish(version)
        self.started = time.perf_counter()

    def next_batch(self, version: int, max_staleness: int) -> Batch:
        return shared_batch(self.connections.fetch_batch(version, max_staleness), self.world)

    def pace(self, version: int, metrics: Mapping[str, float]) -> int:
        return self.pacer.observe(version, metrics).k

    def after_step(self, version: int, metrics: dict[str, float]) -> None:
        """Each part adds its metrics to the step's record in turn: a later one may watch what an earlier one added."""
        if weights_due(version, self.config.learner):
            metrics |= self.sharing(version)
        self.connections.publish_version(version)
        final = version == self.config.learner.total_steps
        metrics |= self._validation_record(version, self.connections.final_validation(version) if final
                                           else self.connections.new_validations())
        metrics |= self.connections.server_metrics(version)
        metrics |= self.tasks.after_step(version, metrics)  # after validation and rollout metrics: it may watch them
        metrics |= self.guard.observe(version, metrics)  # last: it may watch any metric, task weights included
        metrics["timing_s/elapsed"] = time.perf_counter() - self.started
        self.connections.log_metrics(version, metrics)
        log.info(progress_line(version, self.config.learner.total_steps, metrics))

    def _validation_record(self, version: int, passes: list[dict[str, float]]) -> dict[str, float]:
        """The newest of `passes` for step `version`'s record; each older one is logged first in a record of its
        own at the same step (passes that arrive together, as at the final wait, are never merged into one)."""
        for earlier in passes[:-1]:
            self.connections.log_metrics(version, earlier)
        return passes[-1] if passes else {}

    def guard_decision(self) -> GuardDecision:
        return self.guard.agreed_decision(self.world)

    def drain(self, rollback: RollBack, offset: int, ahead: list[int]) -> Drained:
        """The next `rollback.drained_batches` batches at the collapsed version, under its K, consumed unread; the
        version does not move meanwhile, so admission stays paused."""
        samples = groups = 0
        for _ in range(rollback.drained_batches):
            batch = self.connections.fetch_batch(rollback.collapsed_step, rollback.max_staleness)
            samples += sum(len(group.trajectories) for group in batch.groups)
            groups += len(batch.groups) + batch.dropped_stale
            offset, ahead = batch.next_offset, batch.next_ahead
        return Drained(samples, groups, offset, ahead)

    def rolled_back(self, rollback: RollBack, drained: Drained) -> int:
        return self.guard.rolled_back(rollback, drained)

    def resume(self, version: int, task_weights: Mapping[str, Any]) -> None:
        self.sharing(version)
        self.connections.publish_version(version)
        self.tasks.restore(task_weights, version)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"task_weights": self.tasks.state_dict(), "guard": self.guard.state_dict()}

    def committed(self, version: int, buffer_offset: int, buffer_ahead: list[int]) -> None:
        self.connections.commit(version, buffer_offset, buffer_ahead)

    def finish(self, version: int) -> None:
        if self.sharing.snapshots is not None:
            self.sharing.snapshots.close()  # the last snapshot on disk before the job reports its end
        self.connections.finish(version)


class PeerServices:
    """A rank other than 0: its part in rank 0's collectives, nothing else."""

    def __init__(self, config: AsyncRLConfig, world: World, sharing: WeightSharing, guard: GuardFollower | NoGuard,
                 max_staleness: int) -> None:
        self.config, self.world, self.sharing, self.guard = config, world, sharing, guard
        self._max_staleness = max_staleness  # rank 0's pacer chooses K; this rank's stays as resumed

    @classmethod
    def build(cls, config: AsyncRLConfig, world: World, model: torch.nn.Module, resumed: LoopState) -> PeerServices:
        guard = GuardFollower() if config.guard.enabled else NoGuard()
        return cls(config, world, WeightSharing(config, model, world, services=None), guard, resumed.max_staleness)

    @property
    def max_staleness(self) -> int:
        return self._max_staleness

    def begin(self, version: int) -> None:
        self.sharing(version)

    def next_batch(self, version: int, max_staleness: int) -> Batch:
        return shared_batch(None, self.world)

    def pace(self, version: int, metrics: Mapping[str, float]) -> int:
        return self._max_staleness

    def after_step(self, version: int, metrics: dict[str, float]) -> None:
        if weights_due(version, self.config.learner):
            self.sharing(version)

    def guard_decision(self) -> GuardDecision:
        return self.guard.agreed_decision(self.world)

    def drain(self, rollback: RollBack, offset: int, ahead: list[int]) -> Drained:
        return Drained(samples=0, groups=0, next_offset=offset, next_ahead=ahead)  # rank 0 alone reads the buffer

    def rolled_back(self, rollback: RollBack, drained: Drained) -> int:
        return 0

    def resume(self, version: int, task_weights: Mapping[str, Any]) -> None:
        self.sharing(version)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {}  # rank 0 writes the checkpoint's metadata

    def committed(self, version: int, buffer_offset: int, buffer_ahead: list[int]) -> None:
        pass

    def finish(self, version: int) -> None:
        pass


@contextmanager
def rank_services(config: AsyncRLConfig, run_dir: Path, world: World, model: torch.nn.Module,
                  resumed: LoopState, buffer_command: Sequence[str]) -> Iterator[RankServices]:
    """This rank's services, closed on the way out: rank 0's connect to the buffer (starting it with
    `buffer_command` unless buffer.address names one) and open the weight-sync coordinator and the metrics sink."""
    if not world.is_main:
        yield PeerServices.build(config, world, model, resumed)
        return
    connections = LearnerConnections.start(config, run_dir, resumed.buffer_offset, resumed.buffer_ahead, buffer_command)
    try:
        yield RankZeroServices.build(connections, config, run_dir, world, model, resumed)
    finally:
        connections.close()


def weights_due(version: int, settings: LearnerConfig) -> bool:
    """Weights go to the servers every learner.sync_every steps and after the last one."""
    return version % settings.sync_every == 0 or version == settings.total_steps


def shared_batch(batch: Batch | None, world: World) -> Batch:
    """Rank 0's batch (`batch`; None on the other ranks) on every rank, as msgpack bytes."""
    if world.size == 1:
        assert batch is not None
        return batch
    return decode(broadcast_bytes(encode(batch) if batch is not None else None, world), max_bytes=2**62, expect=Batch)


def progress_line(version: int, total: int, metrics: Mapping[str, float]) -> str:
    """The learner's log line for step `version` of `total`: the headline metrics the step logged."""
    fields = [("reward", "critic/score/mean", ".3f"), ("val", "val/score/mean", ".3f"),
              ("staleness", "staleness/mean", ".3f"), ("K", "staleness/max_staleness", "d"), ("pg_loss", "actor/pg_loss", ".3f"),
              ("gen_tok/s", "rollout/tokens_per_s", ".0f"), ("train_tok/s", "learner/tokens_per_s", ".0f"),
              ("sync_s", "weight_sync/seconds", ".3f"), ("wait_s", "timing_s/wait_batch", ".3f"),
              ("step_s", "timing_s/step", ".3f")]
    shown = [f"{label} {metrics[key]:{spec}}" for label, key, spec in fields if key in metrics]
    return " ".join([f"step {version}/{total}", *shown])
