"""How a server's process starts: in a process started before the learner was up, or in a fresh one.

A server's process spends many seconds importing vLLM before it can start an engine (20 s on an H200 host), and
`asyncrl rollout` used to start it only once the learner was up (its addresses known, its settings adopted): the
two waits added up at every job's start. Now the rollout starts one process per server at once (before it imports
torch itself: nothing this module imports loads it), pinned to the GPUs the config already names; it imports while
the learner starts, then waits for what it serves (the adopted config, the learner's endpoints, its place), which
the supervisor sends at that server's first start. The engine itself still starts only then, after the learner has
taken its GPU memory, in the same order as before.

Where the config does not name the servers' GPUs yet (a GPU machine without `rollout.gpus`: only the plan made
after adoption can say), no process is started early. A warm process whose GPUs differ from the server's final
place is stopped unused, and the server starts in a fresh process, as do all restarts."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

from asyncrl.config import AsyncRLConfig
from asyncrl.gpu_ids import listed_server_gpus, pin, visible_gpus
from asyncrl.parent_death import die_with_spawning_parent
from asyncrl.placement import ServerPlace
from rollout_servers.learner_wait import Endpoints
from rollout_servers.server_process import serve_one

NOT_FINISHED = -1  # the job-end value while the learner has not announced its final step
Gpus = tuple[int, ...] | None  # a server process's pinned GPUs (None: none pinned)


@dataclass
class WarmProcess:
    process: BaseProcess
    gpus: Gpus  # pinned before its imports
    starts: Connection  # the supervisor's end of the pipe the process waits on


class ServerStarts:
    """How the supervisor starts a server's process: the warm one waiting for that server, when it is pinned where
    the server's place says, else a fresh one. Also holds `job_end`, which every server process shares: the final
    step the learner announced (NOT_FINISHED until then)."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.job_end: Synchronized = context.Value("q", NOT_FINISHED)
        self.warm: dict[int, WarmProcess] = {}  # by server index: the processes started before the learner was up

    @classmethod
    def cold(cls) -> ServerStarts:
        """Every server in a fresh process."""
        return cls(multiprocessing.get_context("spawn"))

    @classmethod
    def warm_up(cls, config: AsyncRLConfig, run_dir: Path) -> ServerStarts:
        """One process per server started now, each pinned to the GPUs `config` names for it, importing while the
        learner starts; none where the config does not name them (see the module's docstring)."""
        starts = cls.cold()
        for index, gpus in enumerate(named_gpus(config) or []):
            ours, theirs = starts.context.Pipe()
            process = starts.context.Process(target=wait_to_serve, name=f"server-{index}",
                                             args=(theirs, index, str(run_dir), gpus, starts.job_end), daemon=False)
            process.start()
            theirs.close()  # the child's end: the process holds its own copy
            starts.warm[index] = WarmProcess(process, gpus, ours)
        return starts

    def start(self, index: int, config: AsyncRLConfig, endpoints: Endpoints, run_dir: Path,
              place: ServerPlace | None) -> BaseProcess:
        """Server `index`'s process, serving (`serve_one`): the warm one when it fits `place`, else a fresh one."""
        warm = self.warm.pop(index, None)
        if warm is not None and warm.process.is_alive() and warm.gpus == (place.gpus if place else None):
            warm.starts.send((config, endpoints, place))
            warm.starts.close()
            return warm.process
        if warm is not None:
            stop_unused([warm])
        process = self.context.Process(target=serve_one, name=f"server-{index}",
                                       args=(config, index, endpoints, str(run_dir), place, self.job_end), daemon=False)
        process.start()
        return process

    def close(self) -> None:
        """Stop the warm processes no server was started in (the rollout stops before its servers start)."""
        stop_unused(list(self.warm.values()))
        self.warm.clear()


def named_gpus(config: AsyncRLConfig) -> list[Gpus] | None:
    """Each server's GPUs as `config` names them, or None for each on a machine without GPUs; None where only the
    plan can say (GPUs visible, `rollout.gpus` empty)."""
    servers = config.rollout.num_servers
    if config.rollout.gpus:
        places = listed_server_gpus(config)
        return list(places) if len(places) == servers else None  # a wrong count: the plan refuses it, by name
    return [None] * servers if not visible_gpus() else None


def stop_unused(warm: list[WarmProcess]) -> None:
    """Stop each waiting process (it holds nothing yet: it imports or waits) and wait for it."""
    for each in warm:
        each.starts.close()
        if each.process.is_alive():
            each.process.terminate()
    for each in warm:
        each.process.join()


def wait_to_serve(starts: Connection, index: int, run_dir: str, gpus: Gpus, job_end: Synchronized) -> None:
    """A warm server process: pin `gpus`, import the server's code, then serve what the supervisor sends on `starts`
    (the adopted config, the endpoints, the place), or leave when it closes the pipe unused."""
    die_with_spawning_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C while it waits: the supervisor stops it
    if gpus is not None:
        pin(gpus)  # before vLLM first touches CUDA, as `serve_one` does
    with contextlib.suppress(Exception):  # an install that cannot import: `serve_one` reports it, as at a cold start
        import rollout_servers.server  # noqa: F401 (vLLM: seconds of imports, while the learner starts)
    try:
        config, endpoints, place = starts.recv()
    except EOFError:
        return  # not used
    signal.signal(signal.SIGINT, signal.default_int_handler)
    serve_one(config, index, endpoints, run_dir, place, job_end)
