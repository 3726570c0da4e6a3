"""Rank 0's connections to the job outside the learner: the buffer (its own or a given one), the weight-sync
coordinator the rollout servers join, the metrics sink, and the endpoints file through which the servers find
them. What each rank does with them beside training is `learner/services/rank_services.py`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from asyncrl.config import AsyncRLConfig
from asyncrl.net import split_tcp_endpoint
from asyncrl.endpoints import FINISHED_KEY, port_to_bind, remember_ports, remembered_ports, write_endpoints
from asyncrl.messages import Batch
from asyncrl.metrics import MetricsLogger
from asyncrl.transport import BufferConsumer
from asyncrl.validation_scores import VERSION_KEY
from asyncrl.weight_transfer.control_messages import ValidateVersion
from learner.services.buffer_supervisor import BufferSupervisor, connect_or_supervise_buffer
from learner.services.generated_work import generated_work_metrics
from learner.weight_sync.coordinator import RoundReport, SyncCoordinator
from learner.weight_sync.sending_ends import SendingEnds
from asyncrl.weight_transfer.backends import weight_backend

log = logging.getLogger(__name__)



class BatchTimeout(TimeoutError):
    """No full batch arrived within learner.batch_timeout_s."""


@dataclass
class LearnerConnections:
    config: AsyncRLConfig
    run_dir: Path
    consumer: BufferConsumer
    coordinator: SyncCoordinator
    metrics: MetricsLogger
    buffer_process: BufferSupervisor | None  # the buffer this learner started, restarted when it dies
    latest_weights: list[tuple[str, torch.Tensor]] | None = None  # what the servers should hold (catch-up)
    latest_version: int = 0

    @classmethod
    def start(cls, config: AsyncRLConfig, run_dir: Path, start_offset: int, start_ahead: list[int],
              buffer_command: Sequence[str]) -> "LearnerConnections":
        """Connect to the buffer (started with `buffer_command`, the command line of `asyncrl buffer`, unless
        buffer.address names one), open the weight-sync coordinator and the metrics sink, write the endpoints."""
        before = remembered_ports(run_dir)  # a restart binds the ports of the run's first start: servers stay
        buffer_port = port_to_bind("buffer", config.buffer.bind_host, config.buffer.port, before.get("buffer"))
        address, buffer_process = connect_or_supervise_buffer(config, run_dir, buffer_command, port=buffer_port)
        coordinator = _start_coordinator(config, before.get("sync"))
        consumer = BufferConsumer(address, "learner", start_offset=start_offset, start_ahead=start_ahead,
                                  curve_dir=config.buffer.curve_dir,
                                  timeout_s=config.buffer.client_timeout_s, resend_s=config.buffer.client_resend_s,
                                  watch=buffer_process)
        started = {"buffer": address} if buffer_process is not None else {}  # a given buffer (buffer.address) is not ours
        remember_ports(run_dir, {"sync": coordinator.address} | started)
        write_endpoints(run_dir, {"buffer": address, "sync": coordinator.address})
        log.info("buffer at %s, weight sync at %s", address, coordinator.address)
        metrics = MetricsLogger(run_dir, config.metrics, _flat_config(run_dir))
        return cls(config, run_dir, consumer, coordinator, metrics, buffer_process)

    def wait_for_servers(self) -> None:
        """Before the first step, wait up to rollout.connect_timeout_s for rollout.num_servers servers to join, so
        that every server starts from the first weights rather than joining mid-run (a late one would train
        the first steps on the others' samples alone), and so that no server beside the learner sizes its KV cache
        while training allocates on the GPU (the first optimizer step's AdamW state among it), even where servers
        sharing it start their engines in turn; after the timeout, go on with those there."""
        wanted, timeout_s = self.config.rollout.num_servers, self.config.rollout.connect_timeout_s
        log.info("waiting up to %.0fs (rollout.connect_timeout_s) for %d rollout server(s) to join weight sync",
                 timeout_s, wanted)
        joined = self.coordinator.wait_for_members(wanted, timeout_s)
        if len(joined) < wanted:
            log.warning("%d of rollout.num_servers=%d servers joined within %.0fs; training starts with them",
                        len(joined), wanted, timeout_s)

    def fetch_batch(self, version: int, max_staleness: int) -> Batch:
        """`buffer.batch_groups` whole groups fit for `version` under the bound `max_staleness`, which the buffer
        applies from now on; catches lagging servers up while waiting."""
        wanted = self.config.buffer.batch_groups
        groups, offsets, dropped = [], [], 0
        deadline = time.monotonic() + self.config.learner.batch_timeout_s
        while len(groups) < wanted:
            if time.monotonic() > deadline:
                raise BatchTimeout(f"only {len(groups)} of {wanted} groups arrived in {self.config.learner.batch_timeout_s}s")
            self._check_buffer_alive()
            self.catch_up_servers()
            samples = (wanted - len(groups)) * self.config.rollout.sampling.n
            part = self.consumer.next_batch(version, max_samples=samples, wait_s=self.config.rollout.weight_sync.heartbeat_s,
                                            max_staleness=max_staleness)
            groups += part.groups
            offsets += part.offsets
            dropped += part.dropped_stale
        # the consumer's position moved with every part: it is where the whole batch leaves the learner
        return Batch(groups=groups, offsets=offsets, next_offset=self.consumer.position, dropped_stale=dropped,
                     next_ahead=self.consumer.ahead)

    def _check_buffer_alive(self) -> None:
        """Raise, naming the buffer's log, when the buffer this learner started has exited for good (instead of
        the timeouts of requests nobody answers); one that died is being restarted."""
        if self.buffer_process is not None:
            self.buffer_process.check()

    def sync_weights(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> RoundReport:
        self.latest_weights, self.latest_version = weights, version
        report = self.coordinator.broadcast(version, weights)
        if report.failed:
            log.warning("weight sync v%d: %d/%d servers failed: %s", version, len(report.failed), report.servers, report.failed)
        return report

    def release_weights(self) -> None:
        """Drop the latest round's weights (about to be replaced), so that two copies are never held."""
        self.latest_weights = None

    def catch_up_servers(self) -> None:
        """Servers that joined late or missed a round get the latest weights before they sample again."""
        behind = self.coordinator.lagging_members(self.latest_version)
        if behind and self.latest_weights is not None:
            log.info("catching up %s to version %d", behind, self.latest_version)
            self.sync_weights(self.latest_version, self.latest_weights)

    def new_validations(self) -> list[dict[str, float]]:
        """The `val/*` of each validation pass the servers reported since the last call, oldest first."""
        return self.coordinator.new_validations()

    def final_validation(self, version: int) -> list[dict[str, float]]:
        """The servers' passes not logged yet, oldest first, waited for up to validation.final_wait_s until one of
        the final `version` is among them, so that the run's last record holds its held-out reward (the passes
        that arrived by then when no pass runs during the job or the final one never came)."""
        settings = self.config.validation
        if not settings.during_run or not settings.final_wait_s:
            return self.new_validations()
        passes: list[dict[str, float]] = []
        deadline = time.monotonic() + settings.final_wait_s
        log.info("waiting up to %.0fs (validation.final_wait_s) for the servers' validation of the final version %d",
                 settings.final_wait_s, version)
        while time.monotonic() < deadline:
            self.catch_up_servers()  # a server (re)started after the last round must reach the final weights
            self.coordinator.tell_servers(ValidateVersion(version))  # again each time: a server may join late
            passes += self.new_validations()
            if passes and passes[-1][VERSION_KEY] >= version:
                return passes
            time.sleep(self.config.rollout.weight_sync.heartbeat_s)
        log.warning("no validation of the final version %d within validation.final_wait_s=%.0fs", version, settings.final_wait_s)
        return passes

    def publish_version(self, version: int) -> None:
        """Tell the buffer the learner's version: admission widens with it."""
        self.consumer.publish_version(version)

    def server_metrics(self, version: int) -> dict[str, float]:
        """The buffer's counters, what they say of the generated work trained, and the rollout servers' telemetry,
        for step `version`'s record."""
        stats = self.consumer.stats()
        rollout = self.coordinator.rollout_metrics(version)
        return stats.metrics() | generated_work_metrics(stats, int(rollout["rollout/thrown_away_tokens"])) | rollout

    def log_metrics(self, version: int, metrics: dict[str, float]) -> None:
        self.metrics.log(version, metrics)

    def commit(self, version: int, buffer_offset: int, buffer_ahead: list[int]) -> None:
        """The checkpoint of `version` holds the buffer position: the buffer may forget what lies before it."""
        self.consumer.commit(version, buffer_offset, buffer_ahead)

    def finish(self, version: int) -> None:
        """The job ended at `version`: tell the servers (they stop, and `asyncrl rollout` exits), waiting up to
        rollout.weight_sync.liveness_s for each to answer, and leave the end in the endpoints file for a server
        or an `asyncrl rollout` that starts later."""
        log.info("job finished at step %d: telling the rollout servers to stop", version)
        silent = self.coordinator.finish_job(version, self.config.rollout.weight_sync.liveness_s)
        if silent:
            log.warning("%s did not answer the end of the job within rollout.weight_sync.liveness_s", silent)
        write_endpoints(self.run_dir, {FINISHED_KEY: version})

    def close(self) -> None:
        self.metrics.close()
        self.consumer.close()
        self.coordinator.close()
        if self.buffer_process is not None:
            self.buffer_process.stop()


def _start_coordinator(config: AsyncRLConfig, remembered_port: int | None) -> SyncCoordinator:
    """The weight-sync coordinator on rollout.weight_sync.control_bind, whose port 0 means the run's port."""
    sync = config.rollout.weight_sync
    host, port = split_tcp_endpoint(sync.control_bind)
    port = port_to_bind("weight-sync coordinator", host, port, remembered_port)
    weights = SendingEnds(sync.backend, lambda name: weight_backend(name).sending_end(sync.staging_bytes))
    return SyncCoordinator(f"tcp://{host}:{port}", sync.host, sync.port, weights, sync.timeout_s, sync.liveness_s,
                           sync.max_failures, config.buffer.curve_dir)


def _flat_config(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())
