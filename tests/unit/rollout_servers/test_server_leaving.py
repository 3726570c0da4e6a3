"""A rollout server told by the learner that the job finished answers that it leaves (`ServerLeaving`) before it
stops: its teardown waits for the weight-sync task that sends the answer instead of cancelling it first. Without
the answer the learner waits rollout.weight_sync.liveness_s for it at the end of every job. The engine, the
reward scorer and the generation loop are stood in; the learner's coordinator is a real ZeroMQ ROUTER socket."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from asyncrl.messages import encode
from asyncrl.weight_transfer.control_messages import JobFinished, ServerLeaving
from rollout_servers.learner_wait import Endpoints
from rollout_servers.server import RolloutServer
from rollout_servers.sync_client import cancel
from tests.unit.rollout_servers.test_server_groups import build_server
from tests.unit.rollout_servers.test_sync_client import FakeEngine, first_heartbeat, next_reply

FINAL_VERSION = 7
WAIT_S = 10.0  # for what takes a few event-loop turns, with slack for a loaded box


class IdleEngine(FakeEngine):
    """What the server's telemetry reads of an engine that samples nothing."""

    tokens_sampled = 0


async def generate_until_stopped(self: RolloutServer, *args: object) -> None:
    """The generation loop with nothing to generate: it returns once the server stops, as the real one does."""
    await self._stop.wait()


def test_a_server_told_the_job_finished_answers_that_it_leaves_and_stops(tmp_path, monkeypatch):
    monkeypatch.setattr("rollout_servers.server.freeze_startup_heap", lambda: None)  # not in the test process
    monkeypatch.setattr(RolloutServer, "_generate_until_stopped", generate_until_stopped)
    stops_ignored = []  # in the server's own process its stop signals are ignored from then on, not in pytest's
    monkeypatch.setattr("rollout_servers.server.ignore_stop_signals", lambda: stops_ignored.append(True))

    async def scenario() -> object:
        coordinator = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        coordinator.setsockopt(zmq.LINGER, 0)
        coordinator.bind("tcp://127.0.0.1:0")
        server = build_server(tmp_path)
        server.endpoints = Endpoints(buffer="tcp://127.0.0.1:1", sync=coordinator.getsockopt_string(zmq.LAST_ENDPOINT))
        serving = asyncio.ensure_future(server._serve_with(IdleEngine(), scorer=None))  # nothing is scored
        try:
            identity, _ = await first_heartbeat(coordinator)
            await coordinator.send_multipart([identity, encode(JobFinished(FINAL_VERSION))])
            _, answer = await next_reply(coordinator)
            await asyncio.wait_for(serving, WAIT_S)  # and the server stopped
            return answer
        finally:
            await cancel(serving)
            coordinator.close(0)

    assert asyncio.run(scenario()) == ServerLeaving("server-0")
    assert stops_ignored == [True], "a leaving server's teardown must not be cut by a second stop signal"
