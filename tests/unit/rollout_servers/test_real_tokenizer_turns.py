"""Token-in/token-out with Qwen3's real BPE tokenizer and chat template: the ids a multi-turn episode or a chat
session trains are the ids the engine sampled, never the text re-tokenized. The model turns here are sampled
in pieces that the tokenizer would merge when re-tokenizing their text, so any re-tokenization shows as drift."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config.environment import EnvironmentConfig
from asyncrl.config.rollout import ChatEndpointConfig
from asyncrl.environments import ChatDelta
from asyncrl.environments.calculator_tool import CALCULATOR_TOOL
from demo.tiny.vocabulary import build_tokenizer
from rollout_servers.agent_loop import AgentLoop
from rollout_servers.chat.sessions import ChatSessions
from rollout_servers.environments import EnvironmentRegistry
from tests.unit.rollout_servers.test_agent_loop import CALCULATOR_ROW, CALL_SAMPLING, ScriptedEngine
from tests.unit.rollout_servers.test_chat_sessions import OpenPlaces

MAX_MODEL_LEN = 1024
# A hermes call as Qwen3 writes it, sampled as pieces; '"argu' + 'ments"' is not how its BPE splits '"arguments"'.
CALL_PIECES = ['<tool_call>', '\n{"name": "calc", "argu', 'ments": {"expr": "63*43"}}\n</tool_call>']
ANSWER_PIECES = ["The ans", "wer is 2709"]  # " answer" is one token when the text is re-tokenized
TOOL_REPLY = "\n<|im_start|>user\n<tool_response>\n2709\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen3():
    return build_tokenizer("qwen3")


def sampled(tokenizer, pieces: list[str]) -> tuple[list[int], list[float]]:
    """A model turn as the engine returns it: each piece's ids, then the end-of-turn token; log-probs distinct."""
    ids = [token for piece in pieces for token in tokenizer.encode(piece, add_special_tokens=False)]
    ids.append(tokenizer.eos_token_id)
    return ids, [-0.01 * (i + 1) for i in range(len(ids))]


def assert_would_drift(tokenizer, turn_ids: list[int]) -> None:
    """The test's premise: re-tokenizing the turn's text gives other ids than were sampled."""
    text = tokenizer.decode(turn_ids)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.encode(text, add_special_tokens=False) != turn_ids


def test_an_episode_trains_the_sampled_ids_and_renders_only_the_templates_new_tokens(qwen3):
    call, answer = sampled(qwen3, CALL_PIECES), sampled(qwen3, ANSWER_PIECES)
    assert_would_drift(qwen3, call[0])
    assert_would_drift(qwen3, answer[0])
    engine = ScriptedEngine([call, answer])
    loop = AgentLoop(engine, qwen3, EnvironmentRegistry.from_config({"calculator": "calculator"}),
                     EnvironmentConfig(tool_parser="hermes"), MAX_MODEL_LEN)
    episode = asyncio.run(loop.run(CALCULATOR_ROW, CALL_SAMPLING, seed=1))

    assert (episode.finish_reason, episode.error, episode.info) == ("env_done", "", {"tool_calls": 1.0})
    t = episode.trajectory("g", "calculator")
    tool_reply = qwen3.encode(TOOL_REPLY, add_special_tokens=False)  # Qwen3's template: tool results as a user turn
    assert t.completion_ids == call[0] + tool_reply + answer[0]
    assert [token for token, m in zip(t.completion_ids, t.loss_mask) if m] == call[0] + answer[0]
    assert [p for p, m in zip(t.behaviour_logprobs, t.loss_mask) if m] == call[1] + answer[1]
    first_prompt = ChatDelta(qwen3).prompt_ids(CALCULATOR_ROW.messages, [CALCULATOR_TOOL])
    assert t.prompt_ids == first_prompt
    assert [request[0] for request in engine.requests] == [first_prompt, first_prompt + call[0] + tool_reply]


def test_a_chat_session_keeps_the_sampled_ids_across_requests(qwen3):
    first, second = sampled(qwen3, ANSWER_PIECES), sampled(qwen3, ["The ans", "wer is 42"])
    engine = ScriptedEngine([first, second])
    settings = ChatEndpointConfig(enabled=True, max_sessions=1)
    sessions = ChatSessions(engine, qwen3, MAX_MODEL_LEN, settings, "server-1", OpenPlaces(), None)
    user = {"role": "user", "content": "What is 63*43?"}
    reply = asyncio.run(sessions.reply("s", [user], CALL_SAMPLING, seed=3))
    follow_up = {"role": "user", "content": "And 6*7?"}
    asyncio.run(sessions.reply("s", [user, {"role": "assistant", "content": reply.text}, follow_up], CALL_SAMPLING))
    _, group = asyncio.run(sessions.close("s", 1.0))

    (trajectory,) = group.trajectories
    between = qwen3.encode("\n<|im_start|>user\nAnd 6*7?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert trajectory.completion_ids == first[0] + between + second[0]
    assert engine.requests[1][0] == trajectory.prompt_ids + first[0] + between
