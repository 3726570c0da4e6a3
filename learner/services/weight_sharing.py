"""Every rank's part in sending the weights to the rollout servers: gather the full weights, and on rank 0 hand
them to the weight-sync coordinator."""

from __future__ import annotations

import time

import torch

from asyncrl.config import AsyncRLConfig
from learner.distributed import World
from learner.policy.policy_model import DTYPES, PinnedWeights, full_weights, served_weights_device
from learner.services.connections import LearnerConnections
from learner.services.lagged_weights import LaggedWeights
from learner.services.snapshots import SnapshotWriter


class WeightSharing:
    """Gathers the full weights (a collective on every rank) in `model.dtype`, the servers' dtype, and
    broadcasts them from rank 0. They are gathered straight onto the learner's GPU when NCCL sends from
    there and they fit in `rollout.weight_sync.staging_bytes`; otherwise into CPU memory, from where the
    coordinator stages what fits before the servers pause. With `buffer.study_lag_versions` = L, rank 0 keeps
    the last L + 1 versions in CPU memory and sends the one L versions back, except the final version, which
    goes out as itself so that its validation (and anything served after the job) sees the trained policy. With
    `snapshots` (rank 0, `validation.after_run`) the weights of each version due for validation are kept as well."""

    def __init__(self, config: AsyncRLConfig, model: torch.nn.Module, world: World, services: LearnerConnections | None,
                 snapshots: SnapshotWriter | None = None) -> None:
        self.model, self.services, self.snapshots = model, services, snapshots
        self.dtype = DTYPES[config.model.dtype]
        self.final_version = config.learner.total_steps
        lag = config.buffer.study_lag_versions
        self.lagged = LaggedWeights(lag) if lag and services is not None else None
        self.device = served_weights_device(config, model, world)
        gathers_off_gpu = world.device.type == "cuda" and self.device.type == "cpu"
        # reused page-locked buffers would leave every kept lagged version holding the newest weights
        self.pinned = PinnedWeights() if gathers_off_gpu and services is not None and not lag else None

    def __call__(self, version: int) -> dict[str, float]:
        """Share the weights of `version` (or, lagged, of an older one); rank 0 returns the round's metrics, the
        other ranks {}."""
        if self.services is not None:
            self.services.release_weights()  # the previous round's copy goes before the next is gathered
        started = time.perf_counter()
        weights = full_weights(self.model, self.dtype, self.device, keep=self.services is not None, pinned=self.pinned)
        gathered_s = time.perf_counter() - started
        if self.services is None:
            return {}
        if self.snapshots is not None:
            self.snapshots.keep(version, weights)  # the version itself, also where a lagged one is sent
        sent = version
        if self.lagged is not None and version < self.final_version:
            sent, weights = self.lagged.lagged(version, weights)
        report = self.services.sync_weights(sent, weights)
        return {
            "weight_sync/version_sent": float(sent),
            "weight_sync/gather_seconds": gathered_s,
            "weight_sync/seconds": report.seconds,
            "weight_sync/transfer_seconds": report.transfer_seconds,
            "weight_sync/server_pause_seconds": report.max_server_pause_s,
            "weight_sync/servers_ok": float(len(report.succeeded)),
            "weight_sync/servers_failed": float(len(report.failed)),
        }
