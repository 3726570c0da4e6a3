"""Tool calls of a chat reply or an episode's model turn, read by vLLM's own tool-call parser
(`rollout.chat.tool_parser` / `environment.tool_parser`, a name of its `ToolParserManager`, e.g. `hermes`).

The parser reads the reply's text; the session keeps the sampled ids as they are. The client is shown the
parsed view (`content` and `tool_calls` with ids) and sends it back next turn, where only the new
messages after it are rendered: what is trained is always the exact ids sampled.

`tool_choice: "required"` and a named function force a call: a structured-outputs grammar of the server's own
(`call_grammar.py`) constrains the reply to calls in the parser's format (hermes'; JSON for other parsers, read
here as vLLM's server reads it), one with `parallel_tool_calls: false`, each call's arguments of its tool's
`parameters` schema, with no free whitespace. The constrained tokens are the tokens sampled, and their behaviour
log-probs are vLLM's after the grammar's mask, those of the distribution that drew them. With `auto` the reply is
free; `parallel_tool_calls: false` then shows the client its first call only.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from pydantic import TypeAdapter, ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers import ToolParserManager

from rollout_servers.chat.call_grammar import forced_call_grammar, layout_for, named_function
from rollout_servers.vllm_compat import FunctionCall, FunctionDefinition, ToolCall

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
        self._layout = layout_for(name)
        self._tokenizer = tokenizer
        parser_log = logging.getLogger(self._parser.__module__)
        if not any(isinstance(f, OneLineParseErrors) for f in parser_log.filters):
            parser_log.addFilter(OneLineParseErrors())

    def constraint(self, request: ChatCompletionRequest) -> StructuredOutputsParams | None:
        """The grammar that forces the call `request.tool_choice` asks for ("required" or a named function); None
        when the reply is free. Raises `CallGrammarError` for a tool whose parameters cannot be a grammar."""
        if _forces_a_call(request):
            return StructuredOutputsParams(grammar=forced_call_grammar(self._layout, request))
        return None

    def read(self, token_ids: Sequence[int], request: ChatCompletionRequest) -> tuple[str | None, list[Any]]:
        """The reply's content and its vLLM `ToolCall`s ([] when it calls no tool)."""
        ids = list(token_ids)
        if ids and ids[-1] == self._tokenizer.eos_token_id:
            ids = ids[:-1]  # vLLM's own text never holds the token that ended the turn
        # Special tokens kept: some templates mark their tool-call tags special (vLLM's hermes parser asks the same)
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        if _forces_a_call(request) and not self._layout.parsed_by_tool_parser:
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


def _forces_a_call(request: ChatCompletionRequest) -> bool:
    return request.tool_choice == REQUIRED or named_function(request) is not None


def _json_calls(text: str, request: ChatCompletionRequest) -> list[ToolCall]:
    """The calls in a reply forced in the JSON layout: the named function with the whole reply as its arguments, or
    the list of {"name", "parameters"} that "required" asks for ([] when a token cap cut the JSON short)."""
    name = named_function(request)
    if name is not None:
        return [ToolCall(function=FunctionCall(name=name, arguments=text))] if text.strip() else []
    try:
        definitions = _FORCED_CALLS.validate_json(text)
    except ValidationError:
        return []
    return [ToolCall(function=FunctionCall(name=d.name, arguments=json.dumps(d.parameters or {}, ensure_ascii=False)))
            for d in definitions]
