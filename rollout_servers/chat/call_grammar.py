"""The grammar a forced tool call is sampled under (`tool_choice: "required"` or a named function), written here
rather than taken from vLLM's tool parser, so that it leaves the model no free whitespace.

vLLM's grammar for a call (the parser's structural tag, or a JSON schema) lets any run of whitespace stand between
the JSON tokens of the arguments, and a small or undertrained policy spends its whole token cap there
(`{"expr"\\n\\n:\\n\\n\\n…`) without ever closing the call. Here a call is laid out as chat templates write one
(`json.dumps`' separators `", "` and `": "`, nothing else between JSON tokens), so it ends within a fixed number
of tokens beyond its arguments' own.

A tool's arguments follow its `parameters` JSON schema, turned into a grammar by xgrammar, vLLM's
structured-outputs backend, in that fixed layout; the frame around them is the parser's call format:
- hermes: `<tool_call>{"name": <tool>, "arguments": <arguments>}</tool_call>`, a newline allowed inside each tag
  (Qwen2.5's template writes the call on three lines) and between calls;
- any other parser: JSON, as vLLM's server constrains a parser without a call format of its own: the named
  function's arguments alone, or a list of `{"name": <tool>, "parameters": <arguments>}` for "required".
With `parallel_tool_calls: false` the reply is exactly one call; with "required" and parallel calls, one or more.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam, ChatCompletionRequest
from xgrammar import Grammar

from rollout_servers.vllm_compat import FunctionDefinition

SEPARATORS = (", ", ": ")  # json.dumps' item and key separators, which chat templates render calls with (tojson)
FREE_ARGUMENTS = {"type": "object"}  # a tool sent with `strict: false`: any object
NO_ARGUMENTS = {"type": "object", "properties": {}}  # a tool without `parameters` takes none (OpenAI's rule)
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+: ")  # xgrammar's errors start with a time and a C++ source line


class CallGrammarError(ValueError):
    """A tool's parameters cannot be written as a grammar; `field` names them in the request."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class CallLayout(Protocol):
    parsed_by_tool_parser: bool  # False: the endpoint reads the reply itself (the parser does not know the layout)

    def reply(self, arguments: dict[str, Grammar], named: bool, several: bool) -> Grammar:
        """The whole reply: calls of the tools in `arguments` (name → its arguments' grammar), of the one named
        function when `named`, several in a row when `several`."""
        ...


@dataclass(frozen=True)
class TaggedCalls:
    """Each call a JSON object {"name", "arguments"} between two tags, as hermes writes it."""

    begin: str
    end: str
    parsed_by_tool_parser: bool = True

    def reply(self, arguments: dict[str, Grammar], named: bool, several: bool) -> Grammar:
        call = _either(*(self._call(name, grammar) for name, grammar in arguments.items()))
        return _one_or_more(call, separator='"\\n"?') if several else call

    def _call(self, name: str, arguments: Grammar) -> Grammar:
        head = _call_head(name, "arguments")
        return Grammar.concat(_either(_literal(self.begin + head), _literal(self.begin + "\n" + head)), arguments,
                              _either(_literal("}" + self.end), _literal("}\n" + self.end)))


@dataclass(frozen=True)
class JsonCalls:
    """The reply is JSON: the named function's arguments, or a list of {"name", "parameters"} (vLLM's layout for
    a parser without a call format)."""

    parsed_by_tool_parser: bool = False

    def reply(self, arguments: dict[str, Grammar], named: bool, several: bool) -> Grammar:
        if named:
            (only,) = arguments.values()
            return only
        call = _either(*(self._call(name, grammar) for name, grammar in arguments.items()))
        return Grammar.concat(_literal("["), _one_or_more(call, separator='", "') if several else call, _literal("]"))

    @staticmethod
    def _call(name: str, arguments: Grammar) -> Grammar:
        return Grammar.concat(_literal(_call_head(name, "parameters")), arguments, _literal("}"))


LAYOUTS: dict[str, CallLayout] = {"hermes": TaggedCalls("<tool_call>", "</tool_call>")}


def layout_for(tool_parser: str) -> CallLayout:
    """The call format of `tool_parser` (its `ToolParserManager` name); JSON for a parser not listed in LAYOUTS."""
    return LAYOUTS.get(tool_parser, JsonCalls())


def forced_call_grammar(layout: CallLayout, request: ChatCompletionRequest) -> str:
    """The EBNF grammar (xgrammar's dialect, which vLLM's `StructuredOutputsParams(grammar=...)` takes) of a reply
    that makes the call `request.tool_choice` forces. Raises CallGrammarError naming a tool whose parameters cannot
    be written as a grammar."""
    named = named_function(request)
    arguments = {tool.function.name: _arguments(index, tool.function)
                 for index, tool in enumerate(request.tools or []) if named in (None, tool.function.name)}
    several = named is None and request.parallel_tool_calls is not False
    return str(layout.reply(arguments, named=named is not None, several=several))


def named_function(request: ChatCompletionRequest) -> str | None:
    if isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam):
        return request.tool_choice.function.name
    return None


def _arguments(index: int, function: FunctionDefinition) -> Grammar:
    """Compact JSON that `function.parameters` accepts (any object with `strict: false`); `index`: the tool's place
    in the request, for the error's field."""
    schema = FREE_ARGUMENTS if function.strict is False else function.parameters or NO_ARGUMENTS
    try:
        return Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)
    except (RuntimeError, ValueError) as error:
        reason = _LOG_PREFIX.sub("", str(error).strip())
        message = f"tool '{function.name}': its parameters cannot be written as a grammar: {reason}"
        raise CallGrammarError(f"tools[{index}].function.parameters", message) from error


def _call_head(name: str, arguments_key: str) -> str:
    """A call object up to its arguments: the name as a chat template writes it (tojson keeps non-ASCII as is)."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{arguments_key}": '


def _literal(text: str) -> Grammar:
    return Grammar.from_ebnf(f"root ::= {json.dumps(text)}")  # a JSON string is an EBNF string literal


def _either(*grammars: Grammar) -> Grammar:
    return grammars[0] if len(grammars) == 1 else Grammar.union(*grammars)


def _one_or_more(item: Grammar, separator: str) -> Grammar:
    """`item`, then any number of `separator` (an EBNF expression) and `item` again. xgrammar prints a grammar's
    start rule as `root`, so one rule over the printed `item` repeats it; parsed with that rule as the start, the
    grammar prints it as `root` again."""
    return Grammar.from_ebnf(f"{item}\nforced_calls ::= root ({separator} root)*\n", root_rule_name="forced_calls")
