"""Engines sharing a GPU start one at a time: each holds its GPUs' start turn while it starts.

vLLM sizes an engine's KV cache from the GPU memory it sees change while it starts: what another process allocates
meanwhile counts as the engine's own use (a smaller KV cache, or none: "No available memory for the cache blocks"),
and memory another process frees meanwhile stops the start ("Error in memory profiling"). Two servers on one GPU
(`rollout.num_servers=2` beside the learner) would otherwise start together. The turn is a file lock per GPU on the
host (`asyncrl.file_lock`: a holder that dies lets go), so it also orders the engines of separate processes and jobs
on one machine; an engine alone on its GPU takes its turn at once. On a machine without GPUs there is no turn to take:
vLLM's CPU engine sizes its cache from its settings alone."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from asyncrl.file_lock import FileLock

log = logging.getLogger(__name__)

# one lock file per GPU of this host, per user (a file another user made could not be opened for writing)
TURNS_DIR = Path(tempfile.gettempdir()) / f"asyncrl-engine-starts-{os.getuid()}"


class EngineStartTurnTimeout(RuntimeError):
    """Another engine held a GPU's start turn for longer than the wait allowed."""


@contextlib.contextmanager
def engine_start_turn(gpus: Sequence[int], timeout_s: float, starting: str,
                      turns_dir: Path | None = None) -> Iterator[None]:
    """Hold the start turn of each of `gpus` (physical ids) while the block starts one engine (`starting` names it in
    the lock file and the log), waiting up to `timeout_s` for each (EngineStartTurnTimeout past it). Turns are taken
    in the order of the ids, so that engines of several GPUs each never wait for one another in a circle.
    `turns_dir`: where the lock files are (None: this host's, TURNS_DIR)."""
    with contextlib.ExitStack() as held:
        for gpu in sorted(set(gpus)):
            held.callback(_take(gpu, timeout_s, starting, turns_dir or TURNS_DIR).release)
        yield


def _take(gpu: int, timeout_s: float, starting: str, turns_dir: Path) -> FileLock:
    lock = FileLock(turns_dir / f"gpu{gpu}.lock")

    def waiting(holder: str) -> None:
        log.info("%s waits for its turn to start on GPU %d: an engine is starting there (%s)", starting, gpu, holder)

    if not lock.take(timeout_s, waiting, holder=f"{starting} starting"):
        raise EngineStartTurnTimeout(
            f"{starting}: another engine ({lock.holder()}) was still starting on GPU {gpu} after {timeout_s:.0f}s "
            "(rollout.connect_timeout_s); engines sharing a GPU start one at a time")
    return lock
