"""Rank 0 keeps the weights of each version validation is due on (`validation.after_run`; asyncrl/snapshots.py has
the layout), so that `asyncrl evaluate` scores every one of them after the job, off its clock.

The weights are copied to host memory at once (the learner trains on as soon as this returns) and written to disk
by one background thread. One write runs at a time: a second snapshot first waits for the previous one, so at most
two copies are ever held.

Every due version's file stays until `asyncrl evaluate` scores it (and drops it, with --drop-scored), so the disk
must hold all of them: at its first snapshot the writer compares the snapshots still due (this one's size times
their number) with the free space where they go, and stops the job there, naming both, rather than at a full disk
hours later. It counts only this job's snapshots: jobs sharing a disk must leave room for one another."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

from asyncrl.snapshots import INDEX_FILE, SNAPSHOTS_DIR, due_versions, snapshot_due, snapshot_path

log = logging.getLogger(__name__)

NamedWeights = Sequence[tuple[str, torch.Tensor]]
GIB = 2**30


class SnapshotSpaceError(RuntimeError):
    """The disk cannot hold the job's due snapshots."""


class SnapshotWriter:
    def __init__(self, run_dir: Path, every: int, final_version: int) -> None:
        """Snapshots of the multiples of `every` and of `final_version` under `run_dir`."""
        self.run_dir, self.every, self.final_version = run_dir, every, final_version
        (run_dir / SNAPSHOTS_DIR).mkdir(parents=True, exist_ok=True)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="snapshots")
        self._pending: Future | None = None
        self._room_checked = False

    def due(self, version: int) -> bool:
        return snapshot_due(version, self.every, self.final_version)

    def keep(self, version: int, weights: NamedWeights) -> None:
        """Keep `weights` as `version`'s snapshot when it is due (nothing otherwise); they are copied before this
        returns, so the caller may change or free them."""
        if not self.due(version):
            return
        made_at = time.time()
        self.wait()
        if not self._room_checked:
            check_room(self.run_dir / SNAPSHOTS_DIR, weights_bytes(weights), self.remaining(version))
            self._room_checked = True
        self._pending = self._writer.submit(self._write, version, made_at, host_copy(weights))

    def remaining(self, version: int) -> int:
        """Snapshots due from `version` on, `version`'s own included."""
        return sum(1 for due in due_versions(self.every, self.final_version) if due >= version)

    def wait(self) -> None:
        """Until the snapshot being written is on disk (a write's error is raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        self._writer.shutdown()

    def _write(self, version: int, made_at: float, weights: list[tuple[str, torch.Tensor]]) -> None:
        path = snapshot_path(self.run_dir, version)
        partial = path.with_suffix(".partial")
        torch.save(weights, partial)
        os.replace(partial, path)  # the index never names a file half written
        with (self.run_dir / SNAPSHOTS_DIR / INDEX_FILE).open("a") as index:
            index.write(json.dumps({"version": version, "made_at": made_at}) + "\n")
        log.info("snapshot of version %d written to %s", version, path)


def check_room(directory: Path, snapshot_bytes: int, count: int) -> None:
    """SnapshotSpaceError when `count` snapshots of `snapshot_bytes` each do not fit the free space at `directory`."""
    needed, free = snapshot_bytes * count, shutil.disk_usage(directory).free
    log.info("snapshots: %d due, %.2f GiB each, %.1f GiB in all; %.1f GiB free in %s", count, snapshot_bytes / GIB,
             needed / GIB, free / GIB, directory)
    if needed > free:
        raise SnapshotSpaceError(
            f"validation.after_run: the {count} snapshots still due (a version every validation.every up to "
            f"learner.total_steps) take {snapshot_bytes / GIB:.2f} GiB each, {needed / GIB:.1f} GiB in all, but "
            f"{directory} has {free / GIB:.1f} GiB free: raise validation.every, free space there, or score and drop "
            "earlier runs' snapshots (asyncrl evaluate --drop-scored)")


def weights_bytes(weights: NamedWeights) -> int:
    """Bytes of `weights`, a tensor listed under several names (a tied weight) counted once, as torch.save stores it."""
    unique = {id(tensor): tensor for _, tensor in weights}
    return sum(tensor.numel() * tensor.element_size() for tensor in unique.values())


def host_copy(weights: NamedWeights) -> list[tuple[str, torch.Tensor]]:
    """`weights` copied to host memory, a tensor listed under several names (a tied weight) copied once."""
    copies: dict[int, torch.Tensor] = {}
    for _, tensor in weights:
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
    return [(name, copies[id(tensor)]) for name, tensor in weights]
