"""The server's side of weight-sync rounds: heartbeats to the learner's coordinator, and each invite
turned into a (re)join of the transfer group plus an in-flight update of the engine. The learner's other
requests come on the same socket: validate a version (its final one), and the end of the job."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from asyncrl.messages import DecodeError, decode, encode
from asyncrl.transport.control import connect_control
from asyncrl.units import MS_PER_S
from asyncrl.weight_transfer.control_messages import (JobFinished, ServerHeartbeat, ServerLeaving, SyncDone,
                                                      SyncInvite, SyncPrepare, SyncReady, TaskWeights, ValidateVersion)
from asyncrl.weight_transfer.group import retry_helps
from rollout_servers.engine import RolloutEngine

log = logging.getLogger(__name__)


def _ignore(version: int) -> None:
    pass


def _keep_weights(weights: list[float]) -> None:
    pass


async def _leave_at_once(version: int) -> None:
    pass


class SyncClient:
    def __init__(self, address: str, server_id: str, engine: RolloutEngine, ranks: int, heartbeat_s: float,
                 curve_dir: str = "", on_validate: Callable[[int], None] = _ignore,
                 on_finished: Callable[[int], Awaitable[None]] = _leave_at_once,
                 on_task_weights: Callable[[list[float]], None] = _keep_weights, backend: str = "") -> None:
        """`curve_dir`: the job's CURVE keys (buffer.curve_dir), needed when the coordinator has them.
        `backend`: the weight backend this server receives on, announced in every heartbeat (placement decides it
        from where the server runs; "" leaves it to the learner).
        `on_validate(version)`: the learner asks for a validation of `version`; `await on_finished(version)`: the
        job ended at `version`, and once it returns the client tells the learner that the server leaves (the
        learner then closes the buffer), and stops. `on_task_weights(weights)`: draw prompts with these weights."""
        self.server_id, self.engine, self.ranks, self.heartbeat_s = server_id, engine, ranks, heartbeat_s
        self.socket = connect_control(address, curve_dir)
        self.on_validate, self.on_finished, self.on_task_weights = on_validate, on_finished, on_task_weights
        self.backend = backend
        self.last_pause_s = 0.0  # pause-to-resume time of the last successful update
        self.updates = 0  # successful updates
        self.finished = False  # the learner ended the job: no more heartbeats

    async def run(self) -> None:
        """Heartbeat and serve the learner's requests until cancelled or the job is finished."""
        while not self.finished:
            await self.socket.send(encode(self._heartbeat()))
            if await self.socket.poll(int(self.heartbeat_s * MS_PER_S)):
                await self._handle(await self.socket.recv())

    def close(self) -> None:
        self.socket.close(0)

    def _heartbeat(self) -> ServerHeartbeat:
        return ServerHeartbeat(self.server_id, self.ranks, self.engine.current_version, self.engine.needs_catch_up,
                               self.backend)

    async def _handle(self, frame: bytes) -> None:
        try:
            message = decode(frame)
        except DecodeError as error:
            log.warning("ignoring an undecodable weight-sync frame: %s", error)
            return
        if isinstance(message, SyncPrepare):  # answered at once: it tells the learner this server is there now
            await self.socket.send(encode(SyncReady(self.server_id, message.round_id)))
        elif isinstance(message, SyncInvite):
            await self._update(message)
        elif isinstance(message, ValidateVersion):
            self.on_validate(message.version)
        elif isinstance(message, TaskWeights):
            self._take_task_weights(message)
        elif isinstance(message, JobFinished):
            await self.on_finished(message.version)
            await self.socket.send(encode(ServerLeaving(self.server_id)))
            self.finished = True
        else:
            log.warning("ignoring a %s message on the weight-sync socket", type(message).__name__)

    def _take_task_weights(self, message: TaskWeights) -> None:
        try:
            self.on_task_weights(message.weights)
        except ValueError as error:  # the learner's files differ from this server's: keep drawing as before
            log.error("ignoring the learner's task weights of version %d: %s", message.version, error)

    async def _update(self, invite: SyncInvite) -> None:
        done = SyncDone(self.server_id, invite.round_id, ok=False)
        try:
            if invite.init_info:
                await self.engine.join_weight_sync(invite.init_info)
            done.seconds = await self.engine.update_weights(invite.update_info, invite.version)
            done.ok = True
            self.last_pause_s, self.updates = done.seconds, self.updates + 1
        except Exception as error:  # a failed round must not end the server: it catches up next round
            done.error, done.retry_helps = f"{type(error).__name__}: {error}", retry_helps(error)
            log.warning("weight sync round %d failed: %s", invite.round_id, done.error)
        await self.socket.send(encode(done))


async def cancel(task: asyncio.Task) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
