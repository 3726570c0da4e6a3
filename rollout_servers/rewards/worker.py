"""The scoring worker process: loads the reward function once, then scores one request at a time.

Protocol on the worker's pipe: the worker first sends `WorkerReady` (or `WorkerStartFailed` and exits);
then, for each `RewardRequest` it receives, one `RewardResult`. `STOP` (or the pool's end of the pipe
closing) ends it. These are in-process objects between a parent and its own children, never a wire format.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection

from asyncrl.parent_death import die_with_spawning_parent
from rollout_servers.rewards.custom import RewardFunction
from rollout_servers.rewards.results import RewardRequest, RewardResult, describe_exception, result_from_return
from rollout_servers.rewards.terms import RewardSpec, load_reward
from asyncrl.stop_signal import ignore_stop_signals

STOP = None  # sent by the pool to end an idle worker


@dataclass
class WorkerReady:
    """The reward function is loaded; the worker takes requests."""


@dataclass
class WorkerStartFailed:
    """The reward function could not be loaded in the worker; it exits."""

    error: str


def score_request(function: RewardFunction, request: RewardRequest) -> RewardResult:
    """Call a verl reward function on one request; an exception becomes a recorded failure."""
    try:
        returned = function(
            data_source=request.data_source,
            solution_str=request.solution_str,
            ground_truth=request.ground_truth,
            extra_info=request.extra_info,
        )
        # inside the try: converting an odd return value (a numbers.Real that refuses float()) may raise too
        return result_from_return(returned)
    except Exception as error:
        return RewardResult.failure(describe_exception(error))


def worker_main(conn: Connection, spec: RewardSpec) -> None:
    """Entry point of a spawned worker process."""
    die_with_spawning_parent()  # a server killed outright takes its workers along, even mid-call
    # Ctrl-C, and `asyncrl run` stopping a role, signal the whole process group; the pool alone decides when
    # its workers stop (a worker killed first was counted as a death and replaced while the server shut down)
    ignore_stop_signals()
    try:
        function = load_reward(spec)
    except Exception as error:
        conn.send(WorkerStartFailed(describe_exception(error)))
        return
    conn.send(WorkerReady())
    while (request := _next_request(conn)) is not STOP:
        conn.send(score_request(function, request))


def _next_request(conn: Connection) -> RewardRequest | None:
    try:
        return conn.recv()
    except EOFError:  # the pool's process is gone: nobody is left to answer
        return STOP
