"""What the chat endpoint takes from an OpenAI chat-completions body.

The body is parsed by vLLM's own request type (`ChatCompletionRequest`, so types and OpenAI's own rules
are checked as vLLM's server checks them), then every field that was sent is sorted: honoured, ignored
(`IGNORED`, with the reason, and in docs/multi_turn.md) or refused with HTTP 400 naming it.
No field is dropped silently: a refused field would change what is sampled or what the client is told
in a way the trajectory could not record (a penalty makes vLLM's log-probs differ from the distribution
that sampled, `n` > 1 makes several replies to one turn). A tool-call grammar is no such field: vLLM
takes its log-probs after the grammar's mask (`chat_tools.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError

from asyncrl.config.rollout import SamplingConfig
from rollout_servers.chat.sessions import FieldError

SESSION_HEADER = "X-Session-Id"
HONOURED = frozenset({
    "messages", "session_id", "stream", "stream_options", "logprobs", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stop", "seed", "n", "tools", "tool_choice", "parallel_tool_calls",
})
# Sent by clients and harmless to drop: one policy is served, so any `model` name is accepted (GET /v1/models
# names it); `user` is an end-user tag for abuse monitoring, and sessions are named by session_id.
IGNORED = frozenset({"model", "user"})


@dataclass(frozen=True)
class ChatRequest:
    session_id: str
    messages: list[Any]  # as sent: the session compares them with what it recorded
    sampling: SamplingConfig  # rollout.sampling with the request's overrides
    seed: int | None
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    logprobs: bool
    tools: list[dict[str, Any]] | None  # function definitions for the chat template (None: no tools)
    reads_tool_calls: bool  # tools given and tool_choice not "none": the reply is parsed for tool calls (forced
    # by a structured-outputs constraint for "required" or a named function, `ToolCallReader.constraint`)
    parsed: ChatCompletionRequest  # vLLM's view of the body (what its tool parsers read)


def parse_request(body: dict[str, Any], header_session: str, defaults: SamplingConfig,
                  reads_tools: bool) -> ChatRequest:
    """The request in `body` (JSON object), or a `FieldError` (400) that names the field at fault;
    `reads_tools`: the server has a tool-call parser (`rollout.chat.tool_parser`)."""
    _refuse_a_named_tool_not_sent(body)
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        raise FieldError(".".join(map(str, first["loc"])) or "body", first["msg"]) from None
    except VLLMValidationError as error:
        raise FieldError(error.parameter or "body", str(error.args[0])) from None
    _refuse_unsupported(request)
    session_id = request.session_id or header_session
    if not session_id:
        raise FieldError("session_id", f"name the session: 'session_id' in the body or the {SESSION_HEADER} header")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise FieldError("messages", "must be a non-empty list")
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    reads_tool_calls = tools is not None and request.tool_choice != "none"
    if reads_tool_calls and not reads_tools:
        raise FieldError("tools", "this server parses no tool calls: set rollout.chat.tool_parser (e.g. hermes)")
    stream_options = request.stream_options
    return ChatRequest(
        session_id=str(session_id), messages=body["messages"], sampling=_sampling(request, defaults),
        seed=request.seed, stream=bool(request.stream),
        include_usage=bool(stream_options and stream_options.include_usage), logprobs=bool(request.logprobs),
        tools=tools, reads_tool_calls=reads_tool_calls, parsed=request,
    )


def _refuse_a_named_tool_not_sent(body: dict[str, Any]) -> None:
    """Checked before vLLM's own validation, whose error names no field on vLLM 0.24 (a model-wide check there)."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or not isinstance(choice.get("function"), dict):
        return  # a string choice, or a malformed one that vLLM's validation names
    name = choice["function"].get("name")
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    sent = {tool["function"].get("name") for tool in tools
            if isinstance(tool, dict) and isinstance(tool.get("function"), dict)}
    if name not in sent:
        raise FieldError("tool_choice", f"names the function '{name}', which is not among the request's tools")


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    for name in sorted(request.model_fields_set):
        if name in HONOURED or name in IGNORED:
            continue
        if name in (request.model_extra or {}):
            raise FieldError(name, "is not an OpenAI chat-completions field this endpoint knows")
        default = ChatCompletionRequest.model_fields[name].get_default(call_default_factory=True)
        if getattr(request, name) != default:
            raise FieldError(name, "is not supported by this endpoint (the trajectory could not record its effect)")
    if (request.n or 1) != 1:
        raise FieldError("n", "only n=1 is supported (one reply per session turn)")
    if request.stream_options and request.stream_options.continuous_usage_stats:
        raise FieldError("stream_options.continuous_usage_stats", "is not supported; include_usage is")


def _sampling(request: ChatCompletionRequest, defaults: SamplingConfig) -> SamplingConfig:
    stop = request.stop
    overrides = {"temperature": request.temperature, "top_p": request.top_p,
                 "max_tokens": request.max_completion_tokens or request.max_tokens,
                 "stop": ([stop] if isinstance(stop, str) else list(stop)) if stop else None}
    return dataclasses.replace(defaults, n=1, **{key: value for key, value in overrides.items() if value is not None})
