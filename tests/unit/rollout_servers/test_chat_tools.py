"""vLLM's tool parsers read a reply's ids; a parser name that vLLM does not know is named with the config key;
a forced call is constrained by the server's own grammar (`test_call_grammar.py`), read as vLLM's server reads it."""

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from rollout_servers.chat.tools import ToolCallReader, ToolParserError
from tests.unit.rollout_servers.test_agent_loop import EOS, TOKENIZER, ids

REQUEST = ChatCompletionRequest.model_validate({
    "messages": [{"role": "user", "content": "2+3="}],
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
})


def test_hermes_reads_calls_and_content_from_the_sampled_ids():
    reader = ToolCallReader("hermes", TOKENIZER)
    content, (call,) = reader.read(ids('sum: <tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>') + [EOS],
                                   REQUEST)
    assert (content, call.function.name, call.function.arguments) == ("sum: ", "add", '{"a": 2}')
    assert reader.read(ids("5") + [EOS], REQUEST) == (None, [])  # no call: the caller shows the text as it is


def test_an_unknown_parser_is_refused_naming_the_config_key():
    with pytest.raises(ToolParserError, match=r"rollout\.chat\.tool_parser: 'hermez' is not one of vLLM's tool "
                                              r"parsers \(.*hermes.*\)"):
        ToolCallReader("hermez", TOKENIZER)


def test_a_forced_reply_in_the_json_layout_is_read_as_vllms_server_reads_it():
    reader = ToolCallReader("llama3_json", TOKENIZER)  # a parser whose call format the server's grammar does not write
    required = ChatCompletionRequest.model_validate({**REQUEST.model_dump(include={"messages", "tools"}),
                                                     "tool_choice": "required"})
    assert reader.constraint(required).grammar
    _, calls = reader.read(ids('[{"name": "add", "parameters": {"a": 2}}, {"name": "add", "parameters": {}}]') + [EOS],
                           required)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("add", '{"a": 2}'), ("add", "{}")]
    assert reader.read(ids('[{"name": "add", "param') + [EOS], required) == (None, [])  # cut short
    named = ChatCompletionRequest.model_validate({**REQUEST.model_dump(include={"messages", "tools"}),
                                                  "tool_choice": {"type": "function", "function": {"name": "add"}}})
    _, (call,) = reader.read(ids('{"a": 2}') + [EOS], named)
    assert (call.function.name, call.function.arguments) == ("add", '{"a": 2}')


def test_an_unreadable_call_is_logged_on_one_line_and_read_as_no_call(caplog):
    reader = ToolCallReader("hermes", TOKENIZER)
    ToolCallReader("hermes", TOKENIZER)  # a second reader adds no second filter
    with caplog.at_level("ERROR"):
        assert reader.read(ids('<tool_call>{"nme": "add", "arguments": {}}</tool_call>') + [EOS], REQUEST) == (None, [])
    (record,) = [r for r in caplog.records if r.name.startswith("vllm.tool_parsers")]
    assert record.exc_info is None and "KeyError: 'name'" in record.getMessage() and "\n" not in caplog.text.strip()
