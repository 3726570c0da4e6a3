"""`rollout.thinking` where rollouts record completions, on Qwen3's real tokenizer and the scripted engine: a
multi-turn episode, a chat session and a single-turn sample each mask the think blocks under `masked` and render
the empty block after every generation cue under `off`; a server asked to mask with a tokenizer that cannot
fails when it is built, naming the key."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config.environment import EnvironmentConfig
from asyncrl.config.rollout import ChatEndpointConfig
from asyncrl.environments import ChatDelta
from asyncrl.environments.calculator_tool import CALCULATOR_TOOL
from asyncrl.thinking import MASKED, OFF, Thinking, ThinkingError
from demo.tiny.vocabulary import build_tokenizer
from rollout_servers.agent_loop import AgentLoop
from rollout_servers.chat.sessions import ChatSessions
from rollout_servers.completion import Completion
from rollout_servers.environments import EnvironmentRegistry
from tests.unit.rollout_servers.test_agent_loop import CALCULATOR_ROW, CALL_SAMPLING, ScriptedEngine
from tests.unit.rollout_servers.test_chat_sessions import OpenPlaces
from tests.unit.rollout_servers.test_real_tokenizer_turns import CALL_PIECES, MAX_MODEL_LEN, TOOL_REPLY, sampled
from tests.unit.rollout_servers.test_server_groups import build_server

THINK_PIECES = ["<think>", "\nCall the", " tool.\n", "</think>", "\n\n"]
THINK_IDS = [151667, 198, 7220, 279, 5392, 624, 151668, 271]  # their ids: the block is the first 7, then '\n\n'
EMPTY_BLOCK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen3():
    return build_tokenizer("qwen3")


def calculator_loop(engine, tokenizer, thinking: Thinking) -> AgentLoop:
    return AgentLoop(engine, tokenizer, EnvironmentRegistry.from_config({"calculator": "calculator"}),
                     EnvironmentConfig(tool_parser="hermes"), MAX_MODEL_LEN, thinking)


def test_a_masked_episode_trains_the_call_and_the_answer_not_the_thinking_before_the_call(qwen3):
    call = sampled(qwen3, THINK_PIECES + CALL_PIECES)  # thinks, then calls the tool in the same turn
    answer = sampled(qwen3, ["2709"])
    engine = ScriptedEngine([call, answer])
    episode = asyncio.run(calculator_loop(engine, qwen3, Thinking.for_tokenizer(MASKED, qwen3))
                          .run(CALCULATOR_ROW, CALL_SAMPLING, seed=1))

    assert (episode.reward, episode.finish_reason, episode.info) == (1.0, "env_done", {"tool_calls": 1.0})
    t = episode.trajectory("g", "calculator")
    tool_reply = qwen3.encode(TOOL_REPLY, add_special_tokens=False)
    assert t.completion_ids == call[0] + tool_reply + answer[0]
    assert call[0][:8] == THINK_IDS
    assert t.loss_mask == [0] * 7 + [1] * (len(call[0]) - 7) + [0] * len(tool_reply) + [1] * len(answer[0])
    assert t.behaviour_logprobs[:8] == [0.0] * 7 + [call[1][7]]
    assert t.token_versions == [3] * len(t.completion_ids), "masked tokens keep the version that sampled them"


def test_an_episode_with_thinking_off_renders_the_empty_block_after_each_cue(qwen3):
    call, answer = sampled(qwen3, CALL_PIECES), sampled(qwen3, ["2709"])
    engine = ScriptedEngine([call, answer])
    off = Thinking.for_tokenizer(OFF, qwen3)
    episode = asyncio.run(calculator_loop(engine, qwen3, off).run(CALCULATOR_ROW, CALL_SAMPLING, seed=1))

    first_prompt = ChatDelta(qwen3, off).prompt_ids(CALCULATOR_ROW.messages, [CALCULATOR_TOOL])
    assert qwen3.decode(first_prompt).endswith("<|im_start|>assistant\n" + EMPTY_BLOCK)
    tool_reply = qwen3.encode(TOOL_REPLY + EMPTY_BLOCK, add_special_tokens=False)
    assert [request[0] for request in engine.requests] == [first_prompt, first_prompt + call[0] + tool_reply]
    t = episode.trajectory("g", "calculator")
    assert t.loss_mask == [1] * len(call[0]) + [0] * len(tool_reply) + [1] * len(answer[0])


def test_a_masked_chat_session_records_its_replies_thinking_untrained(qwen3):
    first = sampled(qwen3, THINK_PIECES + ["42"])
    second = ([151667, 198, 34301], [-0.1, -0.2, -0.3])  # '<think>\nhm' cut by max_tokens: the block never closed
    engine = ScriptedEngine([first, second])
    sessions = ChatSessions(engine, qwen3, MAX_MODEL_LEN, ChatEndpointConfig(enabled=True), "server-1", OpenPlaces(),
                            None, Thinking.for_tokenizer(MASKED, qwen3))
    user = {"role": "user", "content": "6*7?"}
    reply = asyncio.run(sessions.reply("s", [user], CALL_SAMPLING))
    assert reply.text == "<think>\nCall the tool.\n</think>\n\n42", "the client is shown the whole reply"
    asyncio.run(sessions.reply("s", [user, reply.message(), {"role": "user", "content": "sure?"}], CALL_SAMPLING))
    _, group = asyncio.run(sessions.close("s", 1.0))

    (t,) = group.trajectories
    between = qwen3.encode("\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert t.completion_ids == first[0] + between + second[0]
    assert first[0] == THINK_IDS + [19, 17, qwen3.eos_token_id]  # then '42' and the end of the turn
    assert t.loss_mask == [0] * 7 + [1] * 4 + [0] * len(between) + [0, 0, 0]  # the cut block: masked to its end


def test_a_masked_single_turn_sample_trains_what_follows_its_thinking(qwen3):
    ids, logprobs = sampled(qwen3, THINK_PIECES + ["42"])
    completion = Completion("r0", [1, 2], ids, logprobs, [5] * len(ids), "stop")
    sample = completion.trajectory(0.5, {}, "", "g", "arithmetic", Thinking.for_tokenizer(MASKED, qwen3))
    assert (sample.completion_ids, sample.loss_mask) == (ids, [0] * 7 + [1] * 4)
    assert sample.behaviour_logprobs == [0.0] * 7 + logprobs[7:]
    assert (sample.reward, sample.group_id, sample.token_versions) == (0.5, "g", [5] * 11)


def test_a_server_asked_to_mask_with_the_character_tokenizer_fails_when_built_naming_the_key(tmp_path):
    with pytest.raises(ThinkingError, match="rollout.thinking=masked: the tokenizer has no token for <think>"):
        build_server(tmp_path, "arithmetic", "rollout.thinking=masked")
