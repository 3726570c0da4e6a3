"""Rank 0's side of dynamic task weights: the scheduler sees each step's metrics, and the rollout servers
hear the resulting weights (a `TaskWeights` message every step, so a server that restarts gets them too)."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from asyncrl.config import AsyncRLConfig
from asyncrl.data import load_prompt_file
from learner.services.task_weight_scheduler import TaskWeightScheduler, file_tasks
from asyncrl.weight_transfer.control_messages import TaskWeights
from learner.weight_sync.coordinator import SyncCoordinator

log = logging.getLogger(__name__)


class TaskWeightsPublisher:
    def __init__(self, scheduler: TaskWeightScheduler, coordinator: SyncCoordinator) -> None:
        self.scheduler, self.coordinator = scheduler, coordinator

    @classmethod
    def start(cls, config: AsyncRLConfig, saved: Mapping[str, Any], coordinator: SyncCoordinator) -> TaskWeightsPublisher:
        """The scheduler over data.train_files, at the checkpoint's state when `saved` holds one."""
        data = config.data
        tasks = file_tasks(data.train_files, [load_prompt_file(path, data.skip_bad_rows) for path in data.train_files])
        scheduler = TaskWeightScheduler(tasks, data.weights, data.task_weights)
        if saved:
            scheduler.load_state_dict(saved)
        log.info("dynamic task weights over %s: %s", tasks, [round(w, 3) for w in scheduler.weights])
        return cls(scheduler, coordinator)

    def publish(self, version: int) -> None:
        self.coordinator.tell_servers(TaskWeights(version, self.scheduler.weights))

    def after_step(self, version: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Observe step `version`'s metrics, tell the servers the weights; returns the `tasks/*` metrics."""
        before = self.scheduler.weights
        logged = self.scheduler.observe(version, metrics)
        if self.scheduler.weights != before:
            log.info("step %d: task weights %s", version, [round(w, 3) for w in self.scheduler.weights])
        self.publish(version)
        return logged

    def restore(self, saved: Mapping[str, Any], version: int) -> None:
        """Back to the weights of a checkpoint (a rollback), told to the servers at once as of `version`."""
        if saved:
            self.scheduler.load_state_dict(saved)
        self.publish(version)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()


class FixedTaskWeights:
    """`data.task_weights.enabled` false: the servers keep `data.weights`; a checkpoint carries on the task-weight
    state it was resumed with (or a rollback restored)."""

    def __init__(self, saved: Mapping[str, Any]) -> None:
        self.saved = saved

    def publish(self, version: int) -> None:
        pass

    def after_step(self, version: int, metrics: Mapping[str, float]) -> dict[str, float]:
        return {}

    def restore(self, saved: Mapping[str, Any], version: int) -> None:
        self.saved = saved

    def state_dict(self) -> Mapping[str, Any]:
        return self.saved
