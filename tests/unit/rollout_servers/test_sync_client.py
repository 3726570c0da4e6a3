"""The server's side of a weight-sync round on a real ZeroMQ socket pair, with a fake engine: a prepare
is answered at once, an invite becomes a (re)join plus an update, and nothing the coordinator sends can
end the client."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from asyncrl.messages import decode, encode
from asyncrl.weight_transfer.control_messages import (JobFinished, ServerHeartbeat, ServerLeaving, ServerTelemetry,
                                                      SyncDone, SyncInvite, SyncPrepare, SyncReady, TaskWeights,
                                                      ValidateVersion, ValidationResult)
from asyncrl.weight_transfer.group import WeightTransferError
from rollout_servers.sync_client import SyncClient, cancel
from rollout_servers.telemetry import TelemetrySender

HEARTBEAT_S = 0.05
REPLY_TIMEOUT_S = 10.0  # bound on every wait for the client's answer


class FakeEngine:
    """Records the joins and updates it is asked for; an update raises `failure` while it is set."""

    def __init__(self) -> None:
        self.current_version, self.needs_catch_up, self.inflight_requests = 0, False, 0
        self.joined: list[dict] = []
        self.updates: list[int] = []
        self.failure: Exception | None = None

    async def join_weight_sync(self, init_info: dict) -> None:
        self.joined.append(init_info)

    async def update_weights(self, update_info: dict, version: int) -> float:
        if self.failure is not None:
            raise self.failure
        self.updates.append(version)
        self.current_version = version
        return 0.25


async def next_reply(router: zmq.asyncio.Socket) -> tuple[bytes, object]:
    """The client's next message that is neither a heartbeat nor telemetry, with its routing id."""
    while True:
        identity, frame = await asyncio.wait_for(router.recv_multipart(), REPLY_TIMEOUT_S)
        message = decode(frame)
        if not isinstance(message, (ServerHeartbeat, ServerTelemetry)):
            return identity, message


async def first_heartbeat(router: zmq.asyncio.Socket) -> tuple[bytes, ServerHeartbeat]:
    """The sync client's first heartbeat and its socket's identity (a telemetry sender's messages, which may
    come first from a socket of their own, are passed over)."""
    while True:
        identity, frame = await asyncio.wait_for(router.recv_multipart(), REPLY_TIMEOUT_S)
        message = decode(frame)
        if isinstance(message, ServerHeartbeat):
            return identity, message


async def talk_to_a_client(scenario, backend: str = "") -> FakeEngine:
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    engine = FakeEngine()
    client = SyncClient(router.getsockopt_string(zmq.LAST_ENDPOINT), "s0", engine, 1, HEARTBEAT_S, backend=backend)
    task = asyncio.ensure_future(client.run())
    try:
        await scenario(router, engine)
        assert not task.done(), "the client must keep running"
    finally:
        await cancel(task)
        client.close()
        router.close(0)
    return engine


def test_a_prepare_is_answered_at_once_without_touching_the_engine():
    async def scenario(router, engine):
        identity, heartbeat = await first_heartbeat(router)
        assert heartbeat.server_id == "s0"
        await router.send_multipart([identity, encode(SyncPrepare(round_id=5))])
        _, reply = await next_reply(router)
        assert reply == SyncReady("s0", 5)
        assert engine.joined == [] and engine.updates == []

    asyncio.run(talk_to_a_client(scenario))


def test_every_heartbeat_names_the_backend_the_servers_place_gave_it():
    async def scenario(router, engine):
        for _ in range(2):
            _, heartbeat = await first_heartbeat(router)
            assert (heartbeat.server_id, heartbeat.backend) == ("s0", "ipc")

    asyncio.run(talk_to_a_client(scenario, backend="ipc"))


def test_an_invite_joins_the_new_group_then_updates_and_reports():
    async def scenario(router, engine):
        identity, _ = await first_heartbeat(router)
        invite = SyncInvite(round_id=2, version=3, update_info={"names": []}, init_info={"host": "h", "port": 1})
        await router.send_multipart([identity, encode(invite)])
        _, reply = await next_reply(router)
        assert reply == SyncDone("s0", 2, ok=True, seconds=0.25)
        assert engine.joined == [{"host": "h", "port": 1}] and engine.updates == [3]

    asyncio.run(talk_to_a_client(scenario))


def test_a_failed_update_is_reported_and_the_client_still_answers_the_next_round():
    async def scenario(router, engine):
        identity, _ = await first_heartbeat(router)
        engine.failure = RuntimeError("receive timed out")
        await router.send_multipart([identity, encode(SyncInvite(round_id=1, version=1, update_info={}))])
        _, reply = await next_reply(router)
        assert isinstance(reply, SyncDone) and not reply.ok and "receive timed out" in reply.error and reply.retry_helps
        await router.send_multipart([identity, encode(SyncPrepare(round_id=2))])
        _, reply = await next_reply(router)
        assert reply == SyncReady("s0", 2)

    asyncio.run(talk_to_a_client(scenario))


def test_a_failure_no_retry_can_fix_is_reported_so_after_crossing_vllms_process_boundary_as_text():
    async def scenario(router, engine):
        identity, _ = await first_heartbeat(router)
        refused = WeightTransferError("ipc: the server is not on the learner's GPU", retry_helps=False)
        engine.failure = Exception(f"Call to init_weight_transfer_engine method failed: {refused}")  # as vLLM raises
        await router.send_multipart([identity, encode(SyncInvite(round_id=1, version=1, update_info={}))])
        _, reply = await next_reply(router)
        assert isinstance(reply, SyncDone) and not reply.ok and not reply.retry_helps

    asyncio.run(talk_to_a_client(scenario))


def test_garbage_and_unexpected_messages_are_ignored():
    async def scenario(router, engine):
        identity, _ = await first_heartbeat(router)
        await router.send_multipart([identity, b"\x00not msgpack"])
        await router.send_multipart([identity, encode(ServerHeartbeat("learner?", 1, 0))])  # a kind servers never get
        await router.send_multipart([identity, encode(SyncPrepare(round_id=9))])
        _, reply = await next_reply(router)
        assert reply == SyncReady("s0", 9)  # the first answer: nothing before it was taken for a round

    asyncio.run(talk_to_a_client(scenario))


def test_telemetry_keeps_flowing_while_an_update_holds_the_sync_client():
    """While an update holds the sync client (no heartbeats), the telemetry sender beside it still reports."""

    class SlowEngine(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.updating = False
            self.release = asyncio.Event()

        async def update_weights(self, update_info: dict, version: int) -> float:
            self.updating = True
            await self.release.wait()
            self.updating = False
            return await super().update_weights(update_info, version)

    async def scenario() -> None:
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:0")
        address, engine = router.getsockopt_string(zmq.LAST_ENDPOINT), SlowEngine()
        client = SyncClient(address, "s0", engine, 1, HEARTBEAT_S)
        # each reading says whether it was taken while the update ran (in `inflight`, as a marker)
        sender = TelemetrySender(address, HEARTBEAT_S, lambda: [ServerTelemetry("s0", 0, inflight=int(engine.updating))])
        tasks = [asyncio.ensure_future(client.run()), asyncio.ensure_future(sender.run())]
        try:
            identity, _ = await first_heartbeat(router)
            await router.send_multipart([identity, encode(SyncInvite(round_id=1, version=1, update_info={}))])
            during_update = 0
            while during_update < 3:
                _, frame = await asyncio.wait_for(router.recv_multipart(), REPLY_TIMEOUT_S)
                message = decode(frame)
                during_update += isinstance(message, ServerTelemetry) and message.inflight == 1
            engine.release.set()
            _, reply = await next_reply(router)
            assert reply == SyncDone("s0", 1, ok=True, seconds=0.25)
        finally:
            for task in tasks:
                await cancel(task)
            client.close()
            sender.close()
            router.close(0)

    asyncio.run(scenario())


def test_the_learner_asks_for_a_validation_and_ends_the_job():
    async def scenario() -> tuple[list[int], list[int], object, bool]:
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:0")
        validations, finished = [], []

        async def leave(version: int) -> None:
            finished.append(version)

        client = SyncClient(router.getsockopt_string(zmq.LAST_ENDPOINT), "s0", FakeEngine(), 1, HEARTBEAT_S,
                            on_validate=validations.append, on_finished=leave)
        task = asyncio.ensure_future(client.run())
        try:
            identity, _ = await first_heartbeat(router)
            await router.send_multipart([identity, encode(ValidateVersion(12))])
            await router.send_multipart([identity, encode(JobFinished(12))])
            _, answer = await next_reply(router)
            await asyncio.wait_for(task, REPLY_TIMEOUT_S)  # no more heartbeats: the client is done
            return validations, finished, answer, task.done()
        finally:
            await cancel(task)
            client.close()
            router.close(0)

    validations, finished, answer, done = asyncio.run(scenario())
    assert validations == [12] and finished == [12] and done
    assert answer == ServerLeaving("s0")


def test_the_learners_task_weights_reach_the_server_and_bad_ones_are_ignored():
    async def scenario() -> list[list[float]]:
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:0")
        taken: list[list[float]] = []

        def take(weights: list[float]) -> None:
            if len(weights) != 2:
                raise ValueError("need 2 weights")
            taken.append(weights)

        client = SyncClient(router.getsockopt_string(zmq.LAST_ENDPOINT), "s0", FakeEngine(), 1, HEARTBEAT_S,
                            on_task_weights=take)
        task = asyncio.ensure_future(client.run())
        try:
            identity, _ = await first_heartbeat(router)
            for weights in ([0.25, 0.75], [1.0], [0.1, 0.9]):
                await router.send_multipart([identity, encode(TaskWeights(4, weights))])
            await router.send_multipart([identity, encode(SyncPrepare(round_id=1))])  # answered after the three
            await next_reply(router)
            assert not task.done()
            return taken
        finally:
            await cancel(task)
            client.close()
            router.close(0)

    assert asyncio.run(scenario()) == [[0.25, 0.75], [0.1, 0.9]]


def test_the_telemetry_sender_sends_every_report_each_period():
    reports = [ServerTelemetry("s0", 3, tokens_generated=40), ValidationResult("s0", 3, {"val/score/mean": 0.5})]

    async def scenario() -> list[object]:
        router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:0")
        sender = TelemetrySender(router.getsockopt_string(zmq.LAST_ENDPOINT), HEARTBEAT_S, lambda: reports)
        task = asyncio.ensure_future(sender.run())
        try:
            frames = [await asyncio.wait_for(router.recv_multipart(), REPLY_TIMEOUT_S) for _ in range(2 * len(reports))]
            return [decode(frame) for _, frame in frames]
        finally:
            await cancel(task)
            sender.close()
            router.close(0)

    assert asyncio.run(scenario()) == reports * 2, "both reports, in order, period after period"
