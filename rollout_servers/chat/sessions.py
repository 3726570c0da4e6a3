"""Chat sessions of external agents, recorded token-in/token-out as trajectories.

An agent program talks to the policy through the OpenAI chat-completions endpoint (`chat_endpoint.py`)
and names its conversation with a session id. Clients resend the whole conversation on every request;
the session keeps the exact ids it has sent to the engine, checks that the resent history is what it
recorded (its own replies included, as returned), renders only the new messages as a delta
(`ChatDelta`) and appends them, so the conversation is never re-tokenized. Model tokens keep their
behaviour log-probs and versions, the agent's messages get loss mask 0 (`Transcript`). Closing a
session with a reward turns it into a trajectory; sessions closed with the same `group_id` go to the
buffer together, as one group, once `group_size` of them are closed. A new session waits for a place
within the staleness bound (`ChatAdmission`) before its first turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from asyncrl.config.rollout import ChatEndpointConfig, SamplingConfig
from asyncrl.environments import ChatDelta, Message, Transcript
from asyncrl.messages import Trajectory, TrajectoryGroup
from asyncrl.thinking import Thinking
from rollout_servers.agent_loop import TurnEngine
from rollout_servers.chat.admission import ChatAdmission
from rollout_servers.chat.lost import LostSessions
from rollout_servers.completion import Completion

log = logging.getLogger(__name__)

SESSION_CLOSED = "session_closed"  # finish reason of a chat session's trajectory
CHAT_DATA_SOURCE = "chat"  # data source of session trajectories unless the close request names one


class SessionError(ValueError):
    """A request the session cannot serve; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class FieldError(SessionError):
    """HTTP 400 about one request field, named in OpenAI's error `param`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(400, f"'{field}': {message}")
        self.field = field


ReadToolCalls = Callable[[Sequence[int]], tuple[str | None, list[Any]]]  # reply ids → content, vLLM ToolCalls


@dataclass(frozen=True)
class Reply:
    text: str  # the reply decoded without special tokens
    completion: Completion  # the engine's ids, log-probs and versions of the reply
    prompt_tokens: int  # ids the engine was given for this turn
    content: str | None  # the message content the client is shown (the text less its tool calls)
    tool_calls: list[Any] = field(default_factory=list)  # vLLM `ToolCall`s parsed from the text

    def message(self) -> Message:
        """The assistant message as the client is told it (and must send it back)."""
        message: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        return message


class TurnListener(Protocol):
    """A client reading the turn as it is sampled (a streamed reply)."""

    async def progress(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """The ids and log-probs sampled so far."""

    async def done(self, reply: Reply) -> None:
        """The whole reply; the session records the turn only once this has returned."""


@dataclass
class ChatSession:
    transcript: Transcript
    messages: list[Message]  # the conversation as the client sees it, our replies included
    last_reply: Reply | None = None  # the last turn as the client was told it (its ids end the transcript)
    tools: list[dict[str, Any]] | None = None  # function definitions rendered into the first prompt
    turns: int = 0  # model turns sampled
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request at a time per session


class ChatSessions:
    def __init__(self, engine: TurnEngine, tokenizer: Any, max_model_len: int, settings: ChatEndpointConfig,
                 server_id: str, admission: ChatAdmission, lost: LostSessions | None = None,
                 thinking: Thinking = Thinking()) -> None:
        """`thinking`: how the chat template is rendered and replies' thinking blocks trained (rollout.thinking)."""
        self._engine = engine
        self._admission = admission
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._settings = settings
        self._server_id = server_id
        self._thinking = thinking
        self._chat = ChatDelta(tokenizer, thinking)
        self._sessions: dict[str, ChatSession] = {}
        self._closed: dict[str, list[Trajectory]] = {}  # group id → closed sessions waiting for their group
        self.dropped_idle = 0  # sessions dropped unsent as idle since the server started
        self.tokens_dropped = 0  # model tokens of those sessions: sampled, never sent
        self.lost = lost or LostSessions(None)  # sessions dropped or open before a restart: their requests get 410

    def __len__(self) -> int:
        return len(self._sessions)

    async def reply(self, session_id: str, messages: Sequence[Message], sampling: SamplingConfig,
                    seed: int | None = None, listener: TurnListener | None = None,
                    tools: list[dict[str, Any]] | None = None, read_tool_calls: ReadToolCalls | None = None,
                    constraint: Any = None) -> Reply:
        """The policy's next turn in session `session_id`, whose full conversation so far is `messages`.

        `tools`: the function definitions the chat template shows the model (part of the session's first
        prompt, so every request of a session must send the same); `read_tool_calls` parses the reply's
        ids into the content and tool calls the client is shown (the ids stay as sampled); `constraint`: vLLM's
        structured-outputs grammar the reply must follow (a forced tool call), passed to the engine.

        With a `listener` the turn is recorded only after `listener.done` returned: a client that went
        away mid-reply (its write raised) leaves the session as it was. Either way the same request can be
        resent: a request for the turn already recorded gets that reply again (a client cannot tell
        whether the last bytes of a reply it lost reached its socket before it left)."""
        history = normalized(messages)
        self.drop_idle()
        session = self._sessions.get(session_id) or await self._open(session_id, history)
        async with session.lock:
            try:
                if session.last_reply is not None and history == session.messages[:-1]:
                    if listener is not None:
                        await listener.done(session.last_reply)
                    return session.last_reply
                context, observation, new_messages = self._extend(session, history, tools)
                room = self._max_model_len - len(context)
                if room <= 0:
                    raise SessionError(400, f"session '{session_id}' is at the context length "
                                            f"({self._max_model_len} tokens)")
                turn_sampling = dataclasses.replace(sampling, n=1, max_tokens=min(sampling.max_tokens, room))
                completion = await self._engine.generate(context, turn_sampling, seed=seed,
                                                         on_tokens=listener.progress if listener else None,
                                                         structured_outputs=constraint)
                text = self.decode(completion.token_ids)
                content, tool_calls = read_tool_calls(completion.token_ids) if read_tool_calls else (None, [])
                reply = Reply(text, completion, len(context), content if tool_calls else text, tool_calls)
                if listener is not None:
                    await listener.done(reply)
            except SessionError:
                if not session.turns and self._sessions.get(session_id) is session:
                    self._forget(session_id)  # a refused first request must not hold a place until dropped as idle
                raise
            finally:
                session.last_used = time.monotonic()
            if observation:
                session.transcript.add_observation(observation)
            session.transcript.add_model_turn(completion.token_ids, completion.logprobs, completion.versions,
                                              self._thinking)
            session.messages += [*new_messages, *normalized([reply.message()])]
            session.last_reply, session.turns = reply, session.turns + 1
        return reply

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of a reply as the client sees it (special tokens left out)."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The text of each id (OpenAI's logprobs name every token)."""
        return [self._tokenizer.decode([token_id]) for token_id in token_ids]

    async def close(self, session_id: str, reward: float, group_id: str = "", group_size: int = 1,
                    data_source: str = CHAT_DATA_SOURCE) -> tuple[str, TrajectoryGroup | None]:
        """End a session with its reward: its record id, and the group to send once `group_size` are closed.
        A request still answering the session finishes first: a client may close as soon as it has read a
        streamed reply's last chunk, before the server has recorded that turn."""
        if group_size < 1:
            raise SessionError(400, f"group_size must be at least 1, got {group_size}")
        session = self._sessions.get(session_id)
        if session is None:
            self._refuse_if_lost(session_id)
            raise SessionError(404, f"no open session '{session_id}'")
        async with session.lock:
            if self._sessions.get(session_id) is not session:  # a concurrent close came first
                raise SessionError(404, f"no open session '{session_id}'")
            if not session.turns:
                raise SessionError(400, f"session '{session_id}' has no model turn to train on")
            self._forget(session_id)
        record_id = f"{self._server_id}-chat-{group_id or session_id}"
        trajectory = session.transcript.trajectory(float(reward), record_id, data_source, SESSION_CLOSED, session.turns)
        waiting = self._closed.setdefault(record_id, [])
        waiting.append(trajectory)
        if len(waiting) < group_size:
            return record_id, None
        del self._closed[record_id]
        return record_id, TrajectoryGroup(record_id=record_id, group_id=record_id, server_id=self._server_id,
                                          trajectories=waiting)

    def _refuse_if_lost(self, session_id: str) -> None:
        reason = self.lost.why(session_id)
        if reason is not None:
            raise SessionError(410, f"session '{session_id}' is lost: {reason}. Start a new session (a new "
                                    "session_id) with the conversation so far")

    async def _open(self, session_id: str, messages: list[Message]) -> ChatSession:
        self._refuse_if_lost(session_id)
        opening = len(self._sessions) + self._admission.waiting
        if opening >= self._settings.max_sessions:
            raise SessionError(429, f"{opening} sessions open or opening (rollout.chat.max_sessions); close some first")
        if not messages:
            raise SessionError(400, "messages must not be empty")
        wait_s = self._settings.admission_wait_s
        try:
            await self._admission.enter(wait_s)
        except TimeoutError:
            raise SessionError(503, f"no place for a new session within the staleness bound after {wait_s:g}s "
                                    "(rollout.chat.admission_wait_s): the learner is behind the work in flight; "
                                    "retry later") from None
        if session_id in self._sessions:  # the same session opened by a concurrent request meanwhile
            self._admission.leave()
            return self._sessions[session_id]
        session = ChatSession(Transcript([], self._engine.current_version), [])
        self._sessions[session_id] = session
        self.lost.save_open(self._sessions)
        return session

    def _forget(self, session_id: str, lost_because: str = "") -> None:
        del self._sessions[session_id]
        self._admission.leave()
        if lost_because:
            self.lost.remember(session_id, lost_because)
        self.lost.save_open(self._sessions)

    def _extend(self, session: ChatSession, messages: list[Message],
                tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int], list[Message]]:
        """The ids for the next turn, the delta's ids, and the messages new since the last reply."""
        if not session.turns:
            session.transcript.prompt_ids = self._chat.prompt_ids(messages, tools)
            session.tools = tools
            return session.transcript.context(), [], messages
        if tools != session.tools:
            raise FieldError("tools", "differ from those of the session's first request: they are part of its "
                                      "prompt; send the same tools in every request of a session")
        known = session.messages
        if messages[: len(known)] != known:
            raise SessionError(409, "the conversation differs from what this session recorded (replies must be "
                                    "sent back as returned); start a new session for an edited history")
        new_messages = messages[len(known):]
        if not new_messages:
            raise SessionError(400, "no new message since the last reply")
        _check_tool_answers(new_messages, session.last_reply, len(known))
        observation = self._chat.observation_ids(new_messages, session.last_reply.completion.token_ids, tools)
        return session.transcript.context() + observation, observation, new_messages

    def drop_idle(self) -> int:
        """Drop, unsent, the sessions with no request for `session_idle_s` (none that is being answered now),
        giving their places back; return how many. An agent that crashed leaves its sessions holding places
        that its group-mates and the server's prompts need, and the learner may be waiting for them."""
        cutoff = time.monotonic() - self._settings.session_idle_s
        idle = [s for s, session in self._sessions.items() if session.last_used < cutoff and not session.lock.locked()]
        for session_id in idle:
            self.tokens_dropped += sum(self._sessions[session_id].transcript.loss_mask)
            self._forget(session_id, f"dropped after {self._settings.session_idle_s:g}s without a request "
                                     "(rollout.chat.session_idle_s), unsent")
        self.dropped_idle += len(idle)
        if idle:
            log.warning("dropped %d chat session(s) without a request for %.0fs (rollout.chat.session_idle_s), unsent; "
                        "their admission places are free again", len(idle), self._settings.session_idle_s)
        return len(idle)


def normalized(messages: Sequence[Any]) -> list[Message]:
    """OpenAI messages as {"role", "content"} with text content (parts joined, null as ""), plus an assistant
    message's `tool_calls` (id, name, arguments) and a tool message's `tool_call_id`: the fields a chat
    template renders and a resent history is compared on."""
    result = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise FieldError(f"messages[{index}]", "must be an object with a 'role'")
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(_text_part(part, f"messages[{index}].content[{number}]")
                              for number, part in enumerate(content))
        if not isinstance(content, str):
            raise FieldError(f"messages[{index}].content", "must be a string or a list of text parts")
        entry: Message = {"role": message["role"], "content": content}
        if message["role"] == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = [_tool_call(call, f"messages[{index}].tool_calls[{number}]")
                                   for number, call in enumerate(message["tool_calls"])]
        if message["role"] == "tool":
            entry["tool_call_id"] = str(message.get("tool_call_id") or "")
        result.append(entry)
    return result


def _text_part(part: Any, where: str) -> str:
    """A text part's text; any other part (an image, audio) is refused: the policy here reads text only."""
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise FieldError(where, "only text parts ({'type': 'text', 'text': ...}) are supported")
    return part["text"]


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    try:
        function = call["function"]
        return {"id": str(call["id"]), "type": "function",
                "function": {"name": str(function["name"]), "arguments": str(function["arguments"])}}
    except (TypeError, KeyError) as error:
        raise FieldError(where, f"a tool call needs id, function.name and function.arguments ({error})") from None


def _check_tool_answers(new_messages: list[Message], last_reply: Reply, first_index: int) -> None:
    """After a reply that called tools, each tool message must answer one of its calls, by id."""
    call_ids = [call.id for call in last_reply.tool_calls]
    if not call_ids:
        return
    for offset, message in enumerate(new_messages):
        if message["role"] == "tool" and message["tool_call_id"] not in call_ids:
            raise FieldError(f"messages[{first_index + offset}].tool_call_id",
                             f"'{message['tool_call_id']}' answers no call of the last reply (its calls: "
                             f"{', '.join(call_ids)})")
