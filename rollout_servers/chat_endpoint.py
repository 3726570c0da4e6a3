"""OpenAI-compatible chat-completions endpoint of a rollout server (aiohttp, on the server's event loop).

    POST /v1/chat/completions        OpenAI's request body plus "session_id" (or header X-Session-Id)
    POST /v1/sessions/{id}/close     {"reward": float, "group_id"?: str, "group_size"?: int, "data_source"?: str}
    GET  /v1/models                  the served model

Each reply is one engine request sampled like training rollouts (config sampling; the request's
temperature, top_p, max_tokens / max_completion_tokens, stop and seed override it). A closed session
becomes a trajectory (`chat_sessions.py`) and its group is sent to the buffer like any other, under the
record id `<server_id>-chat-<group_id or session_id>`, so a resent close is stored once. A new session
waits for a place within the staleness bound (`chat_admission.py`); without one in time it gets HTTP 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web

from asyncrl.config.rollout import ChatEndpointConfig, SamplingConfig
from asyncrl.messages import Ack, TrajectoryGroup
from rollout_servers.chat_sessions import CHAT_DATA_SOURCE, ChatSessions, Reply, SessionError

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
IDLE_CHECKS_PER_LIMIT = 10  # idle sessions are looked for this many times per rollout.chat.session_idle_s (dropped ≤ 10 % late)
GroupSink = Callable[[TrajectoryGroup], Awaitable[Ack]]  # sends a finished group to the buffer


class ChatEndpoint:
    def __init__(self, sessions: ChatSessions, sampling: SamplingConfig, model_name: str, sink: GroupSink) -> None:
        self.sessions = sessions
        self._sampling = sampling
        self._model_name = model_name
        self._sink = sink
        self._runner: web.AppRunner | None = None
        self._idle_checks: asyncio.Task | None = None
        self.port = 0

    async def start(self, settings: ChatEndpointConfig, port: int) -> int:
        """Listen on `settings.host`:`port` (0 = a free port); returns the port."""
        app = web.Application()
        app.add_routes([
            web.post("/v1/chat/completions", self._completions),
            web.post("/v1/sessions/{session_id}/close", self._close),
            web.get("/v1/models", self._models),
        ])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, settings.host, port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._idle_checks = asyncio.create_task(self._drop_idle_sessions(settings.session_idle_s / IDLE_CHECKS_PER_LIMIT))
        log.info("chat endpoint on http://%s:%d/v1", settings.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._idle_checks is not None:
            self._idle_checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_checks
        if self._runner is not None:
            await self._runner.cleanup()

    async def _drop_idle_sessions(self, every_s: float) -> None:
        """Sessions also go idle when no request comes at all (the agent crashed): look for them on a clock."""
        while True:
            await asyncio.sleep(every_s)
            self.sessions.drop_idle()

    async def _completions(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            session_id = str(body.get("session_id") or request.headers.get(SESSION_HEADER, ""))
            if not session_id:
                raise SessionError(400, f"name the session: 'session_id' in the body or the {SESSION_HEADER} header")
            if body.get("n", 1) != 1:
                raise SessionError(400, "only n=1 is supported (one reply per session turn)")
            sampling = self._request_sampling(body)
            reply = await self.sessions.reply(session_id, body.get("messages") or [], sampling, body.get("seed"))
        except SessionError as error:
            return _error(error.status, str(error))
        return web.json_response(self._completion_body(reply, session_id, bool(body.get("logprobs"))))

    async def _close(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        try:
            body = await _json_body(request)
            reward = body.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise SessionError(400, "'reward' must be a number")
            record_id, group = self.sessions.close(
                session_id, float(reward), str(body.get("group_id") or ""), int(body.get("group_size", 1)),
                str(body.get("data_source") or CHAT_DATA_SOURCE))
        except (SessionError, ValueError) as error:
            return _error(getattr(error, "status", 400), str(error))
        if group is None:
            return web.json_response({"session_id": session_id, "record_id": record_id, "sent": False})
        ack = await self._sink(group)
        if ack.error:
            return _error(502, f"the buffer refused record {record_id}: {ack.error}")
        log.info("chat group %s (%d sessions) sent to the buffer at offset %d", record_id, group.num_samples(), ack.offset)
        return web.json_response({"session_id": session_id, "record_id": record_id, "sent": True,
                                  "offset": ack.offset, "duplicate": ack.duplicate})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self._model_name, "object": "model",
                                                              "owned_by": "asyncrl"}]})

    def _request_sampling(self, body: dict[str, Any]) -> SamplingConfig:
        overrides = {"temperature": body.get("temperature"), "top_p": body.get("top_p"),
                     "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens")}
        stop = body.get("stop")
        if stop is not None:
            overrides["stop"] = [stop] if isinstance(stop, str) else list(stop)
        try:
            return dataclasses.replace(self._sampling, n=1, **{k: v for k, v in overrides.items() if v is not None})
        except TypeError as error:
            raise SessionError(400, f"bad sampling field: {error}") from error

    def _completion_body(self, reply: Reply, session_id: str, with_logprobs: bool) -> dict[str, Any]:
        completion = reply.completion
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": reply.text},
            "finish_reason": completion.finish_reason,
        }
        if with_logprobs:
            tokens = self.sessions.tokens(completion.token_ids)
            choice["logprobs"] = {"content": [{"token": token, "logprob": logprob, "bytes": None, "top_logprobs": []}
                                              for token, logprob in zip(tokens, completion.logprobs)]}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self._model_name,
            "session_id": session_id,
            "choices": [choice],
            "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(completion.token_ids),
                      "total_tokens": reply.prompt_tokens + len(completion.token_ids)},
        }


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as error:
        raise SessionError(400, f"the body is not JSON: {error}") from error
    if not isinstance(body, dict):
        raise SessionError(400, "the body must be a JSON object")
    return body


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                             status=status)
