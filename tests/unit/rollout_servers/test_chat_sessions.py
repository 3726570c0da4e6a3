"""Chat sessions on the scripted engine: token-in/token-out across requests, history checks, limits and
groups of closed sessions."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config.rollout import ChatEndpointConfig
from asyncrl.environments import ChatDelta
from rollout_servers.chat_sessions import ChatSessions, SessionError, normalized
from tests.unit.rollout_servers.test_agent_loop import EOS, SAMPLING, TOKENIZER, ScriptedEngine, ids, turn

USER = {"role": "user", "content": "hi"}


def sessions_on(engine, max_sessions: int = 4) -> ChatSessions:
    return ChatSessions(engine, TOKENIZER, 256, ChatEndpointConfig(enabled=True, max_sessions=max_sessions), "server-1")


def test_two_requests_extend_the_ids_and_close_into_a_trajectory():
    engine = ScriptedEngine([turn("ab", -0.5), turn("c", -1.5)], updates={0: 4})
    sessions = sessions_on(engine)
    first = asyncio.run(sessions.reply("s", [USER], SAMPLING, seed=3))
    assert first.text == "ab" and first.prompt_tokens == len(ChatDelta(TOKENIZER).prompt_ids([USER]))
    tool = {"role": "tool", "content": "42", "tool_call_id": "x"}  # extra OpenAI fields are ignored
    history = [USER, {"role": "assistant", "content": [{"type": "text", "text": "ab"}]}, tool]
    second = asyncio.run(sessions.reply("s", history, SAMPLING))
    assert second.text == "c"
    observation = ids("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    prompt = ChatDelta(TOKENIZER).prompt_ids([USER])
    assert engine.requests[1][0] == prompt + ids("ab") + [EOS] + observation

    record_id, group = sessions.close("s", 1.0)
    (trajectory,) = group.trajectories
    assert record_id == group.record_id == trajectory.group_id == "server-1-chat-s"
    assert trajectory.completion_ids == ids("ab") + [EOS] + observation + ids("c") + [EOS]
    assert trajectory.loss_mask == [1] * 3 + [0] * len(observation) + [1] * 2
    assert trajectory.token_versions == [3] * (3 + len(observation)) + [4] * 2
    assert (trajectory.reward, trajectory.num_turns, trajectory.data_source) == (1.0, 2, "chat")
    assert len(sessions) == 0


def test_history_must_extend_what_the_session_recorded():
    sessions = sessions_on(ScriptedEngine([turn("ab", -0.5)]))
    asyncio.run(sessions.reply("s", [USER], SAMPLING))
    edited = [USER, {"role": "assistant", "content": "AB"}, USER]
    with pytest.raises(SessionError, match="differs from what this session recorded") as error:
        asyncio.run(sessions.reply("s", edited, SAMPLING))
    assert error.value.status == 409
    with pytest.raises(SessionError, match="no new message") as error:
        asyncio.run(sessions.reply("s", [USER, {"role": "assistant", "content": "ab"}], SAMPLING))
    assert error.value.status == 400


def test_session_limit_groups_and_closing_errors():
    sessions = sessions_on(ScriptedEngine([turn("x", -1.0)]), max_sessions=2)
    for name in ("a", "b"):
        asyncio.run(sessions.reply(name, [USER], SAMPLING))
    with pytest.raises(SessionError, match="2 sessions open") as error:
        asyncio.run(sessions.reply("c", [USER], SAMPLING))
    assert error.value.status == 429
    assert sessions.close("a", 0.0, group_id="g", group_size=2) == ("server-1-chat-g", None)
    record_id, group = sessions.close("b", 1.0, group_id="g", group_size=2)
    assert [t.reward for t in group.trajectories] == [0.0, 1.0] and record_id == "server-1-chat-g"
    with pytest.raises(SessionError, match="no open session 'a'") as error:
        sessions.close("a", 1.0)
    assert error.value.status == 404


def test_messages_are_normalized_to_role_and_text():
    assert normalized([{"role": "assistant", "content": None, "tool_calls": []}]) == [{"role": "assistant", "content": ""}]
    with pytest.raises(SessionError, match=r"messages\[0\] must be an object with a 'role'"):
        normalized(["hi"])
