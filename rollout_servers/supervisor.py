"""`asyncrl rollout`: start N rollout server processes and keep them running.

A server that exits is restarted with exponential back-off; one that keeps dying soon after it starts is
given up on after `rollout.max_restarts` such restarts in a row, or as soon as the same error ended two of them in
a row (`asyncrl.restarts`): an engine that cannot run the model fails alike at every start. A restarted server
resumes its numbered prompt stream from the state it keeps in the run dir: the prompts its previous process drew
and never got acknowledged are regenerated first (under the grants the buffer still counts for it), each group
under the same record id, so every prompt reaches the buffer exactly once (see `rollout_servers.prompt_stream`).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from asyncrl.config import AsyncRLConfig
from asyncrl.endpoints import ENDPOINTS_FILE, FINISHED_KEY, read_endpoints
from asyncrl.exit_codes import CANNOT_START, LEARNER_MOVED
from asyncrl.stop_signal import StopSignal
from asyncrl.placement import ServerPlace
from asyncrl.restarts import GiveUp, QuickDeaths
from rollout_servers.learner_wait import Endpoints, LearnerFinished
from rollout_servers.server_starts import NOT_FINISHED, ServerStarts
from rollout_servers.server_logs import read_error, server_error_file, server_log

log = logging.getLogger(__name__)

_POLL_S = 0.5  # supervisor's check interval for dead servers and the stop signal


class SupervisorGaveUp(RuntimeError):
    """A server is not restarted again; the supervisor stops with the reason and `exit_code`."""

    exit_code = 1


class ServerCannotStart(SupervisorGaveUp):
    """A server could not be built from the config's inputs, or failed alike at its starts in a row (its engine
    cannot run the model): the same config or install would fail again."""

    exit_code = CANNOT_START


class ServerKeepsFailing(SupervisorGaveUp):
    """A server died `rollout.max_restarts` + 1 times in a row, each soon after it started."""


@dataclass
class ServerSlot:
    """One server index: its current process and the restart bookkeeping that outlives it."""

    deaths: QuickDeaths  # deaths in a row soon after a start: back-off and giving up
    process: multiprocessing.Process | None = None
    started_at: float = 0.0  # monotonic time the current process started
    next_start: float = 0.0  # monotonic time the next process may start


def find_endpoints(config: AsyncRLConfig, run_dir: Path, timeout_s: float) -> Endpoints:
    """Explicit addresses from config, else the learner's endpoints file in the run dir (waited for);
    LearnerFinished when the file says that the job is over."""
    if config.buffer.address and config.rollout.weight_sync.control_address:
        return Endpoints(config.buffer.address, config.rollout.weight_sync.control_address)
    deadline = time.monotonic() + timeout_s
    while (found := read_endpoints(run_dir)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no learner endpoints at {run_dir / ENDPOINTS_FILE} after {timeout_s:.0f}s: start `asyncrl learner` "
                "with the same run.name, or set buffer.address and rollout.weight_sync.control_address"
            )
        time.sleep(_POLL_S)
    if FINISHED_KEY in found:
        raise LearnerFinished(found[FINISHED_KEY])
    return Endpoints(config.buffer.address or found["buffer"], config.rollout.weight_sync.control_address or found["sync"],
                     run_dir)


def supervise(config: AsyncRLConfig, run_dir: Path, endpoints_dir: Path,
              places: Sequence[ServerPlace] | None = None, starts: ServerStarts | None = None) -> int | None:
    """Run `rollout.num_servers` servers until SIGINT/SIGTERM (None) or the end of the learner's job (its final
    step); restart the ones that die (`SupervisorGaveUp` when one cannot start or keeps dying). Endpoints are
    looked up at every (re)start, so servers follow a learner that restarted on new addresses.
    `places[i]`: where server i runs: its GPUs, weight backend and memory share (None: as the config says, on
    every GPU it sees). `starts`: the processes started before the learner was up, for the first starts (None:
    every server in a fresh process)."""
    starts = starts or ServerStarts.cold()
    stop = StopSignal()
    job_end = starts.job_end  # a server writes the final step the learner announced
    slots = [ServerSlot(QuickDeaths.of(config.rollout, config.rollout.max_restarts)) for _ in range(config.rollout.num_servers)]
    try:
        while not stop.requested and job_end.value == NOT_FINISHED:
            for index, slot in enumerate(slots):
                if slot.process is not None and slot.process.is_alive():
                    continue
                if job_end.value != NOT_FINISHED:  # it exited because the job is over
                    break
                if slot.process is not None and slot.process.exitcode == LEARNER_MOVED:
                    slot.process = None  # not a death: it starts again at once, on the learner's new addresses
                if slot.process is not None:
                    schedule_restart(slot, index, run_dir, time.monotonic())
                if time.monotonic() >= slot.next_start:
                    endpoints = find_endpoints(config, endpoints_dir, config.rollout.connect_timeout_s)
                    place = places[index] if places is not None else None
                    slot.process = starts.start(index, config, endpoints, run_dir, place)
                    slot.started_at = time.monotonic()
            time.sleep(_POLL_S)
    except LearnerFinished as finished:  # found in the endpoints file while a server was to (re)start
        return finished.version
    finally:
        starts.close()
        _stop_all([slot.process for slot in slots if slot.process is not None], config.rollout.stop_timeout_s)
    return None if job_end.value == NOT_FINISHED else job_end.value


def schedule_restart(slot: ServerSlot, index: int, run_dir: Path, now: float) -> None:
    """Book the restart of the dead process in `slot` after its back-off, or raise `SupervisorGaveUp`."""
    code = slot.process.exitcode
    if code == CANNOT_START:
        raise ServerCannotStart(f"server-{index} cannot start from this config or install (not restarted): see {server_log(run_dir, index)}")
    ran_s = now - slot.started_at
    error = read_error(server_error_file(run_dir, index))
    give_up = GiveUp(f"server-{index}", "rollout.max_restarts", server_log(run_dir, index), ServerCannotStart,
                     ServerKeepsFailing)
    delay = slot.deaths.next_restart(ran_s, error, f"last exit code {code}", give_up)
    log.warning("server-%d exited with code %s after %.0fs%s; restart in %.1fs (%s)", index, code, ran_s,
                f" ({error})" if error else "", delay, slot.deaths.describe())
    slot.process, slot.next_start = None, now + delay


def _stop_all(processes: list[multiprocessing.Process], timeout_s: float) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0))
        if process.is_alive():
            process.kill()
            process.join()
