"""vLLM's tool parsers read a reply's ids; a parser name that vLLM does not know is named with the config key."""

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from rollout_servers.chat_tools import ToolCallReader, ToolParserError
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
