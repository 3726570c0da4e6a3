"""One rollout server in the process the supervisor started for it (`serve_one`): its logs and error file set up,
its GPUs pinned, the server built and served until a stop signal or the job's end; the exit code tells the
supervisor whether a restart can help."""

from __future__ import annotations

import asyncio
import logging
import sys
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

from asyncrl.config import AsyncRLConfig
from asyncrl.exit_codes import CANNOT_START, LEARNER_MOVED
from asyncrl.gpu_ids import pin
from asyncrl.heap import ended_normally
from asyncrl.logs import setup_logging
from asyncrl.parent_death import die_with_spawning_parent
from asyncrl.placement import ServerPlace
from asyncrl.stop_signal import ignore_stop_signals, interrupt_once
from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment
from rollout_servers.learner_wait import Endpoints, LearnerFinished, LearnerMoved
from rollout_servers.server_logs import expect_errors, record_server_error, server_error_file, server_log

log = logging.getLogger(__name__)

STATE_DIR = "rollout"  # under the run dir: each server's prompt-stream position (`PromptStream`)


def serve_one(config: AsyncRLConfig, index: int, endpoints: Endpoints, run_dir: str, place: ServerPlace | None = None,
              job_end: Synchronized | None = None) -> None:
    """Server `index` in this process until a stop signal or the end of the job, whose final step goes to
    `job_end`. Exits CANNOT_START if it cannot be built, LEARNER_MOVED when the learner came back on other
    addresses, 1 (the error and its traceback in the server's log, the error alone in its error file, or its
    engine's there) on any other failure. `place`: its GPUs, weight backend and memory share (None: the GPUs the
    process found, and the config's settings)."""
    die_with_spawning_parent()  # a supervisor killed outright takes its servers along
    setup_logging(f"rollout{index}", config.run.log_level, server_log(run_dir, index))
    expect_errors(server_error_file(run_dir, index))  # before vLLM's processes start: they inherit where to record
    interrupt_once()  # a second stop (the run's, then the supervisor's) must not break the server's teardown
    if place is not None:
        pin(place.gpus)  # before vLLM first touches CUDA
        place.apply(config)  # this process's own copy: the other servers keep theirs
        log.info("%s", place.describe(index))
    prepare_nccl_environment(config.rollout.weight_sync.host)  # before vLLM's workers start: they inherit it
    try:
        # Imported here, in the server's own process: vLLM takes seconds of CPU to import, and the supervisor (and
        # every other process that imports this module) never runs an engine. An install that cannot import
        # (a broken or missing vLLM) is no more fixed by a restart than a bad config.
        from rollout_servers.server import RolloutServer
        server = RolloutServer(config, index, endpoints, Path(run_dir) / STATE_DIR)
    except Exception as error:
        log.exception("server-%d cannot start: %s: %s", index, type(error).__name__, error)
        sys.exit(CANNOT_START)
    try:
        asyncio.run(server.serve())
    except KeyboardInterrupt:
        log.info("server-%d stopped", index)
    except LearnerFinished as finished:  # while it waited for the learner
        server.finish(finished.version)
    except LearnerMoved as moved:
        log.info("server-%d restarts: %s", index, moved)
        sys.exit(LEARNER_MOVED)
    except Exception as error:
        log.exception("server-%d failed: %s: %s", index, type(error).__name__, error)
        record_server_error(error)
        sys.exit(1)
    finally:
        ignore_stop_signals()  # whatever ended it, its exit path (multiprocessing's, vLLM's atexit) runs to its end
    if server.finished_version is not None and job_end is not None:
        job_end.value = server.finished_version
    ended_normally()
