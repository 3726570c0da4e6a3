"""The grammar of a forced tool call, run as vLLM runs it (xgrammar's matcher over the character tokenizer's ids,
ending with the end-of-turn token): a call laid out as chat templates write it, with its tool's arguments, and
nothing else; no whitespace beyond the separators' single space; hermes' tags or JSON by the parser; one call or
several; a tool whose parameters cannot be a grammar refused naming it."""

from __future__ import annotations

import pytest
import xgrammar
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from rollout_servers.chat.call_grammar import CallGrammarError, forced_call_grammar, layout_for
from tests.unit.rollout_servers.test_agent_loop import EOS, TOKENIZER, ids

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 4}}, "required": ["text"]}}}
TOOLS = [ADD, NOTE]
COMPILER = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(TOKENIZER))


def follows(grammar: str, reply: str) -> bool:
    """Whether the engine could sample `reply` and then end the turn under `grammar`."""
    matcher = xgrammar.GrammarMatcher(COMPILER.compile_grammar(grammar))
    return all(matcher.accept_token(token) for token in ids(reply) + [EOS]) and matcher.is_terminated()


def grammar(tool_choice, tools=TOOLS, parser: str = "hermes", **fields) -> str:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "2+3="}], "tools": tools,
                                                    "tool_choice": tool_choice, **fields})
    return forced_call_grammar(layout_for(parser), request)


def named(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


def call(name: str, arguments: str) -> str:
    return '<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % (name, arguments)


def test_required_takes_a_call_of_any_tool_written_as_the_template_writes_it():
    required = grammar("required")
    assert follows(required, call("add", '{"a": 2, "b": 3}'))
    assert follows(required, call("add", '{"a": 2}'))  # an optional field may be left out
    assert follows(required, call("note", '{"text": "hi"}'))
    assert follows(required, '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')  # Qwen2.5's lines
    assert follows(required, call("add", '{"a": 2}') + call("note", '{"text": "hi"}'))  # parallel calls allowed
    assert follows(required, call("add", '{"a": 2}') + "\n" + call("add", '{"a": 3}'))


@pytest.mark.parametrize("reply", [
    call("add", '{"a":2}'),  # no space after the colon
    call("add", '{"a": 2,"b": 3}'),  # no space after the comma
    call("add", '{ "a": 2}'),
    call("add", '{"a": 2 }'),
    call("add", '{"a":  2}'),
    call("add", '{"a"\n: 2}'),
    call("add", '{"a": 2}') + "\n\n" + call("add", '{"a": 3}'),
    '<tool_call> {"name": "add", "arguments": {"a": 2}}</tool_call>',
    call("add", '{"a": 2}') + " ",
    "sure: " + call("add", '{"a": 2}'),
])
def test_no_whitespace_beyond_the_separators_single_space(reply):
    assert not follows(grammar("required"), reply)


@pytest.mark.parametrize("arguments", ['{"b": 3}', '{"a": "2"}', '{"a": 2, "c": 1}', '{"b": 3, "a": 2}', "2", "{}"])
def test_the_arguments_follow_the_tools_schema(arguments):
    # a missing required field, a wrong type, a field the schema does not list, another order, not an object
    assert not follows(grammar("required"), call("add", arguments))


def test_the_length_of_a_string_argument_is_bounded_by_its_schema():
    assert follows(grammar(named(NOTE)), call("note", '{"text": "four"}'))
    assert not follows(grammar(named(NOTE)), call("note", '{"text": "fives"}'))


def test_a_named_function_is_the_only_call():
    add = grammar(named(ADD))
    assert follows(add, call("add", '{"a": 2}'))
    assert not follows(add, call("note", '{"text": "hi"}'))
    assert not follows(add, call("add", '{"a": 2}') + call("add", '{"a": 3}'))  # one call, whatever parallel says
    assert not follows(add, "")


def test_parallel_calls_off_makes_the_reply_exactly_one_call():
    one = grammar("required", parallel_tool_calls=False)
    assert follows(one, call("note", '{"text": "hi"}'))
    assert not follows(one, call("add", '{"a": 2}') + call("add", '{"a": 3}'))
    assert not follows(one, call("add", '{"a": 2}') + "\n" + call("add", '{"a": 3}'))


def test_a_tool_sent_with_strict_false_takes_any_object_and_one_without_parameters_takes_none():
    free = {"type": "function", "function": {**ADD["function"], "strict": False}}
    assert follows(grammar("required", [free]), call("add", '{"x": [1, {"y": null}], "a": "two"}'))
    assert not follows(grammar("required", [free]), call("add", "2"))
    assert not follows(grammar("required", [free]), call("add", '{"x":1}'))  # still without free whitespace
    bare = {"type": "function", "function": {"name": "now"}}
    assert follows(grammar("required", [bare]), call("now", "{}"))
    assert not follows(grammar("required", [bare]), call("now", '{"a": 1}'))


def test_a_parser_without_a_call_format_gets_json_as_vllms_server_sets_it():
    required = grammar("required", parser="llama3_json")
    assert follows(required, '[{"name": "add", "parameters": {"a": 2}}, {"name": "note", "parameters": {"text": "x"}}]')
    assert not follows(required, '[{"name": "add", "parameters": {"a": 2}},{"name": "add", "parameters": {"a": 2}}]')
    assert not follows(required, "[]")
    assert not follows(required, call("add", '{"a": 2}'))
    one = grammar("required", parser="llama3_json", parallel_tool_calls=False)
    assert follows(one, '[{"name": "add", "parameters": {"a": 2}}]')
    assert not follows(one, '[{"name": "add", "parameters": {"a": 2}}, {"name": "add", "parameters": {"a": 2}}]')
    add = grammar(named(ADD), parser="llama3_json")
    assert follows(add, '{"a": 2, "b": 3}') and not follows(add, '{"a":2}')


def test_a_schema_that_cannot_be_a_grammar_is_refused_naming_the_tool_and_its_field():
    broken = {"type": "function", "function": {"name": "when", "parameters": {
        "type": "object", "properties": {"at": {"type": "moment"}}}}}
    with pytest.raises(CallGrammarError, match=r"tool 'when': its parameters cannot be written as a grammar: "
                                               r"Unsupported type \"moment\"$") as error:
        grammar("required", [ADD, broken])
    assert error.value.field == "tools[1].function.parameters"
    dangling = {"type": "function", "function": {"name": "ref", "parameters": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(CallGrammarError, match="tool 'ref'.*missing") as error:
        grammar(named(dangling), [dangling])
    assert error.value.field == "tools[0].function.parameters"
    assert follows(grammar(named(ADD), [ADD, broken]), call("add", '{"a": 2}'))  # a tool the choice leaves out
