"""OpenAI-compatible chat-completions endpoint of a rollout server (aiohttp, on the server's event loop).

    POST /v1/chat/completions        OpenAI's request body plus "session_id" (or header X-Session-Id)
    POST /v1/sessions/{id}/close     {"reward": float, "group_id"?: str, "group_size"?: int, "data_source"?: str}
    GET  /v1/models                  the served model

Each reply is one engine request sampled like training rollouts (config sampling; the fields the request
may set are in `request.py`), answered whole or streamed (`stream.py`), with tool calls read by
vLLM's parser (`tools.py`); with an API key every route needs it (`auth.py`). A closed session
becomes a trajectory (`sessions.py`) and its group is sent to the buffer on the path of any other group
(acknowledged, sent again while the learner is away, waited for when the server leaves: `buffer_calls.py`), under
the record id `<server_id>-chat-<group_id or session_id>`, so a resent close is stored once; a close that comes
while the server leaves gets HTTP 503. A new session waits for a place within the staleness bound
(`admission.py`); without one in time it gets HTTP 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from asyncrl.config.rollout import ChatEndpointConfig, SamplingConfig
from asyncrl.messages import Ack, TrajectoryGroup
from asyncrl.transport.sockets import BufferRequestError
from rollout_servers.buffer_calls import ServerStopping
from rollout_servers.chat.auth import refuse_open_bind, require_key
from rollout_servers.chat.request import SESSION_HEADER, parse_request
from rollout_servers.chat.sessions import CHAT_DATA_SOURCE, ChatSessions, FieldError, SessionError
from rollout_servers.chat.stream import ReplyFormat, ReplyShape, StreamedReply
from rollout_servers.chat.call_grammar import CallGrammarError
from rollout_servers.chat.tools import ToolCallReader

log = logging.getLogger(__name__)

IDLE_CHECKS_PER_LIMIT = 10  # idle sessions are looked for this many times per rollout.chat.session_idle_s (dropped ≤ 10 % late)
GroupSink = Callable[[TrajectoryGroup], Awaitable[Ack]]  # the server's one path to the buffer (`BufferCalls`)


class ChatEndpoint:
    def __init__(self, sessions: ChatSessions, sampling: SamplingConfig, model_name: str, sink: GroupSink,
                 tool_calls: ToolCallReader | None = None) -> None:
        self.sessions = sessions
        self._tool_calls = tool_calls  # rollout.chat.tool_parser's reader; None = requests with tools get 400
        self._sampling = sampling
        self._model_name = model_name
        self._sink = sink
        self._runner: web.AppRunner | None = None
        self._idle_checks: asyncio.Task | None = None
        self.port = 0

    async def start(self, settings: ChatEndpointConfig, port: int, api_key: str | None = None) -> int:
        """Listen on `settings.host`:`port` (0 = a free port); returns the port. With `api_key` every
        request must carry it (`auth.py`); without one only a loopback host is allowed (`ApiKeyError`)."""
        refuse_open_bind(settings.host, api_key)
        app = web.Application(middlewares=[require_key(api_key)] if api_key else [])
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
        log.info("chat endpoint on http://%s:%d/v1 (%s)", settings.host, self.port,
                 "API key required" if api_key else "no API key: loopback only")
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

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        listener = None
        try:
            chat = parse_request(await _json_body(request), request.headers.get(SESSION_HEADER, ""), self._sampling,
                                 reads_tools=self._tool_calls is not None)
            shape = ReplyShape(chat.session_id, self._model_name, chat.logprobs, chat.include_usage,
                               holds_back_content=chat.reads_tool_calls)
            reply_format = ReplyFormat(shape, self.sessions.tokens)
            listener = StreamedReply(request, reply_format, self.sessions.decode) if chat.stream else None
            read_tool_calls, constraint = None, None
            if chat.reads_tool_calls:
                constraint = self._forced_call(chat.parsed)
                read_tool_calls = functools.partial(self._tool_calls.read, request=chat.parsed)
            reply = await self.sessions.reply(chat.session_id, chat.messages, chat.sampling, chat.seed, listener,
                                              chat.tools, read_tool_calls, constraint)
        except SessionError as error:
            return _error(error.status, str(error), getattr(error, "field", None))
        except ConnectionError:  # the client left mid-stream: its turn was not recorded (sessions.reply)
            if listener is None:
                raise
            log.info("chat client of session '%s' left mid-reply; nothing new is recorded", chat.session_id)
            return listener.response
        if listener is not None:
            return listener.response
        return web.json_response(reply_format.completion(reply))

    def _forced_call(self, parsed: Any) -> Any:
        """The grammar that forces the call `tool_choice` asks for ("required" or a named function); None when the
        reply is free. A tool whose parameters cannot be a grammar gets a 400 naming them."""
        try:
            return self._tool_calls.constraint(parsed)
        except CallGrammarError as error:
            raise FieldError(error.field, str(error)) from error

    async def _close(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        try:
            body = await _json_body(request)
            reward = body.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise SessionError(400, "'reward' must be a number")
            record_id, group = await self.sessions.close(
                session_id, float(reward), str(body.get("group_id") or ""), int(body.get("group_size", 1)),
                str(body.get("data_source") or CHAT_DATA_SOURCE))
        except (SessionError, ValueError) as error:
            return _error(getattr(error, "status", 400), str(error))
        if group is None:
            return web.json_response({"session_id": session_id, "record_id": record_id, "sent": False})
        try:
            ack = await self._sink(group)
        except ServerStopping as error:
            return _error(503, f"record {record_id} was not sent: {error}")
        except BufferRequestError as error:
            return _error(502, f"the buffer refused record {record_id}: {error}")
        log.info("chat group %s (%d sessions) sent to the buffer at offset %d", record_id, group.num_samples(), ack.offset)
        return web.json_response({"session_id": session_id, "record_id": record_id, "sent": True,
                                  "offset": ack.offset, "duplicate": ack.duplicate})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self._model_name, "object": "model",
                                                              "owned_by": "asyncrl"}]})

async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as error:
        raise SessionError(400, f"the body is not JSON: {error}") from error
    if not isinstance(body, dict):
        raise SessionError(400, "the body must be a JSON object")
    return body


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                        "code": status}}, status=status)
