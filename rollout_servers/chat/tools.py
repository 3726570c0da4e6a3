"""Tool calls of a chat reply or an episode's model turn, read by vLLM's own tool-call parser
(`rollout.chat.tool_parser` / `environment.tool_parser`, a name of its `ToolParserManager`, e.g. `hermes`).

The parser reads the reply's text; the session keeps the sampled ids as they are. The client is shown the
parsed view (`content` and `tool_calls` with ids) and sends it back next turn, where only the new
messages after it are rendered: what is trained is always the exact ids sampled.

`tool_choice: "required"`, a named function and `parallel_tool_calls: false` are served as vLLM's own server
serves them (`vllm_compat.tool_call_constraint`): a structured-outputs grammar on the reply forces the call
(in the parser's own format where it has a structural tag, as hermes does; else as JSON, read as vLLM's
server reads it) and allows at most one with `parallel_tool_calls: false`. A forced call's arguments follow
its tool's `parameters` schema: its tools are given to vLLM's grammar builder as `strict` unless the client
set `strict: false`. The constrained tokens are the tokens sampled, and their
behaviour log-probs are vLLM's after the grammar's mask, those of the distribution that drew them.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from pydantic import TypeAdapter, ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam, ChatCompletionRequest
from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers import ToolParserManager

from rollout_servers.vllm_compat import FunctionCall, FunctionDefinition, ToolCall, tool_call_constraint

REQUIRED = "required"
_FORCED_CALLS = TypeAdapter(list[FunctionDefinition])  # the JSON a "required" reply is constrained to


class ToolParserError(ValueError):
    """The configured parser does not exist; the message names the config key."""


class OneLineParseErrors(logging.Filter):
    """A policy in training writes malformed calls all the time; vLLM's parsers log each with its traceback
    (15 lines for a typo in the JSON). This keeps the record and its level, with the exception on one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()} ({type(error).__name__}: {error})", ()
            record.exc_info, record.exc_text = None, None
        return True


class ToolCallReader:
    """One server's parser class and tokenizer; a parser object per reply (parsers keep per-request state)."""

    def __init__(self, name: str, tokenizer: Any, key: str = "rollout.chat.tool_parser") -> None:
        try:
            self._parser = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})
            raise ToolParserError(f"{key}: '{name}' is not one of vLLM's tool parsers ({', '.join(known)})") from None
        self._name = name
        self._tokenizer = tokenizer
        parser_log = logging.getLogger(self._parser.__module__)
        if not any(isinstance(f, OneLineParseErrors) for f in parser_log.filters):
            parser_log.addFilter(OneLineParseErrors())

    def constraint(self, request: ChatCompletionRequest) -> StructuredOutputsParams | None:
        """The grammar that forces the call `request.tool_choice` asks for ("required" or a named function) or
        allows one call at most (`parallel_tool_calls: false`), as vLLM's server sets it; None when unconstrained."""
        if forces_a_call(request):
            return tool_call_constraint(self._name, self._tokenizer, _arguments_pinned(request))
        if request.parallel_tool_calls is False:
            return tool_call_constraint(self._name, self._tokenizer, request)
        return None

    def read(self, token_ids: Sequence[int], request: ChatCompletionRequest,
             json_reply: bool = False) -> tuple[str | None, list[Any]]:
        """The reply's content and its vLLM `ToolCall`s ([] when it calls no tool); `json_reply`: the reply was
        constrained to JSON (a forced call with a parser that has no structural tag), read as vLLM's server reads it."""
        ids = list(token_ids)
        if ids and ids[-1] == self._tokenizer.eos_token_id:
            ids = ids[:-1]  # vLLM's own text never holds the token that ended the turn
        # Special tokens kept: some templates mark their tool-call tags special (vLLM's hermes parser asks the same)
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        if json_reply:
            content, calls = None, _json_calls(text, request)
        else:
            parsed = self._parser(self._tokenizer, request.tools).extract_tool_calls(text, request)
            content, calls = parsed.content, list(parsed.tool_calls) if parsed.tools_called else []
        if not calls:
            return None, []
        return content, calls[:1] if request.parallel_tool_calls is False else calls

    def read_turn(self, token_ids: Sequence[int], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """An episode's model turn's calls of `tools` in OpenAI's form ({"id", "type", "function": {"name",
        "arguments"}}), for its environment."""
        request = ChatCompletionRequest.model_validate({"messages": [], "tools": tools})
        _, calls = self.read(token_ids, request)
        return [call.model_dump(exclude_none=True) for call in calls]


def forces_a_call(request: ChatCompletionRequest) -> bool:
    return request.tool_choice == REQUIRED or isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam)


def _arguments_pinned(request: ChatCompletionRequest) -> ChatCompletionRequest:
    """A copy of `request` whose tools are `strict` unless the client said `strict: false`: vLLM 0.32's grammar
    leaves a non-strict tool's arguments free (any JSON value, even a bare number) unless the tool is strict,
    so a forced call would follow no schema; 0.24's pins them already, and strict tools are pinned by both."""
    tools = [tool if tool.function.strict is not None
             else tool.model_copy(update={"function": tool.function.model_copy(update={"strict": True})})
             for tool in request.tools or []]
    return request.model_copy(update={"tools": tools})


def _json_calls(text: str, request: ChatCompletionRequest) -> list[ToolCall]:
    """The calls in a constrained reply: the named function with the whole reply as its arguments, or the
    list of {"name", "parameters"} that "required" asks for ([] when a token cap cut the JSON short)."""
    if isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam):
        name = request.tool_choice.function.name
        return [ToolCall(function=FunctionCall(name=name, arguments=text))] if text.strip() else []
    try:
        definitions = _FORCED_CALLS.validate_json(text)
    except ValidationError:
        return []
    return [ToolCall(function=FunctionCall(name=d.name, arguments=json.dumps(d.parameters or {}, ensure_ascii=False)))
            for d in definitions]
