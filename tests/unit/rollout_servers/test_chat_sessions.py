"""Chat sessions on the scripted engine: token-in/token-out across requests, history checks, limits,
groups of closed sessions, and places within the staleness bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.config.rollout import ChatEndpointConfig
from asyncrl.environments import ChatDelta
from rollout_servers.chat.admission import ChatAdmission
from rollout_servers.chat.endpoint import ChatEndpoint
from rollout_servers.chat.lost import RESTARTED, LostSessions
from rollout_servers.chat.sessions import ChatSessions, SessionError, normalized
from tests.unit.rollout_servers.test_agent_loop import EOS, SAMPLING, TOKENIZER, ScriptedEngine, ids, turn
from waiting import wait_until_async

USER = {"role": "user", "content": "hi"}
SHORT_WAIT_S = 0.05
IDLE_S = 0.2  # session_idle_s of the idle tests: checked every 20 ms
WAIT_S = 5.0  # for what takes a few event-loop turns, with slack for a loaded box


class OpenPlaces(ChatAdmission):
    """A place for every session at once (how places are granted is tested in test_chat_admission.py)."""

    def __init__(self) -> None:
        super().__init__(sessions_per_group=1)

    async def enter(self, timeout_s: float) -> None:
        self.open += 1


def sessions_on(engine, max_sessions: int = 4, places: ChatAdmission | None = None,
                admission_wait_s: float = SHORT_WAIT_S, lost: LostSessions | None = None,
                settings: ChatEndpointConfig | None = None) -> ChatSessions:
    """Sessions on `engine`; a test that changes a setting as it goes passes its own `settings`."""
    settings = settings or ChatEndpointConfig(enabled=True, max_sessions=max_sessions, admission_wait_s=admission_wait_s)
    return ChatSessions(engine, TOKENIZER, 256, settings, "server-1", places or OpenPlaces(), lost)


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

    record_id, group = asyncio.run(sessions.close("s", 1.0))
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
    assert asyncio.run(sessions.close("a", 0.0, group_id="g", group_size=2)) == ("server-1-chat-g", None)
    record_id, group = asyncio.run(sessions.close("b", 1.0, group_id="g", group_size=2))
    assert [t.reward for t in group.trajectories] == [0.0, 1.0] and record_id == "server-1-chat-g"
    with pytest.raises(SessionError, match="no open session 'a'") as error:
        asyncio.run(sessions.close("a", 1.0))
    assert error.value.status == 404


def test_a_new_session_waits_for_a_place_and_gives_it_back_when_closed_or_dropped():
    places = ChatAdmission(sessions_per_group=2)
    settings = ChatEndpointConfig(enabled=True, admission_wait_s=WAIT_S)
    sessions = sessions_on(ScriptedEngine([turn("x", -1.0)]), places=places, settings=settings)

    async def open_two_then_a_third():
        first = asyncio.create_task(sessions.reply("a", [USER], SAMPLING))
        await wait_until_async(lambda: places.waiting, WAIT_S, "the first session waiting for a place")
        waited = (len(sessions), places.wanted())  # no place yet: the server asks admission for one group
        places.take_grants(1)
        await first
        await sessions.reply("b", [USER], SAMPLING)  # the group's second place needs no new grant
        settings.admission_wait_s = SHORT_WAIT_S
        with pytest.raises(SessionError, match="no place for a new session") as error:
            await sessions.reply("c", [USER], SAMPLING)
        return waited, error.value.status

    assert asyncio.run(open_two_then_a_third()) == ((0, 1), 503)
    assert (len(sessions), places.open, places.held, places.waiting) == (2, 2, 1, 0), "the refused one holds nothing"
    asyncio.run(sessions.close("a", 1.0))
    assert (places.open, places.held) == (1, 1)
    settings.session_idle_s = 0.0  # from now on a session without a request in flight is idle
    with pytest.raises(SessionError, match="no place"):  # the idle one is dropped first: its place is given back
        asyncio.run(sessions.reply("c", [USER], SAMPLING))
    assert (len(sessions), places.open, places.held) == (0, 0, 0)


def test_messages_are_normalized_to_role_and_text():
    assert normalized([{"role": "assistant", "content": None, "tool_calls": []}]) == [{"role": "assistant", "content": ""}]
    with pytest.raises(SessionError, match=r"'messages\[0\]': must be an object with a 'role'"):
        normalized(["hi"])
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]
    assert normalized([{"role": "user", "content": parts[:1] * 2}]) == [{"role": "user", "content": "aa"}]
    with pytest.raises(SessionError, match=r"'messages\[0\]\.content\[1\]': only text parts"):  # never dropped silently
        normalized([{"role": "user", "content": parts}])


def test_idle_sessions_are_dropped_on_a_clock_when_no_request_comes():
    """An agent that crashed sends nothing more: its sessions must still give their places back."""
    places = OpenPlaces()
    settings = ChatEndpointConfig(enabled=True, session_idle_s=IDLE_S)
    sessions = sessions_on(ScriptedEngine([turn("ab", -0.5), turn("c", -0.5)]), places=places, settings=settings)

    async def open_two_then_go_quiet() -> tuple[int, float]:
        endpoint = ChatEndpoint(sessions, SAMPLING, "tiny", sink=None)
        await endpoint.start(settings, 0)
        try:
            await sessions.reply("a", [USER], SAMPLING)
            last_request = time.monotonic()  # before the last request ends: b cannot be idle sooner than IDLE_S after
            await sessions.reply("b", [USER], SAMPLING)
            opened = len(sessions)
            await wait_until_async(lambda: len(sessions) == 0, IDLE_S * 3, "the idle sessions dropped")
            return opened, time.monotonic() - last_request
        finally:
            await endpoint.stop()

    opened, dropped_after_s = asyncio.run(open_two_then_go_quiet())
    assert opened == 2 and dropped_after_s >= IDLE_S  # not before they were idle for session_idle_s
    assert places.open == 0


class HeldAtTheEnd:
    """A turn listener that holds the turn after its last chunk (before it is recorded) until `finish` is set."""

    def __init__(self) -> None:
        self.finishing = asyncio.Event()
        self.finish = asyncio.Event()

    async def progress(self, token_ids, logprobs) -> None:
        pass

    async def done(self, reply) -> None:  # the last chunk is out; recording comes after this returns
        self.finishing.set()
        await self.finish.wait()


def test_a_session_being_answered_is_not_idle():
    settings = ChatEndpointConfig(enabled=True, session_idle_s=0.0)  # idle as soon as no request is in flight
    sessions = sessions_on(ScriptedEngine([turn("ab", -0.5)]), settings=settings)

    async def drop_while_answering() -> int:
        listener = HeldAtTheEnd()
        answering = asyncio.create_task(sessions.reply("a", [USER], SAMPLING, listener=listener))
        await listener.finishing.wait()
        dropped = sessions.drop_idle()
        listener.finish.set()
        await answering
        return dropped

    assert asyncio.run(drop_while_answering()) == 0 and len(sessions) == 1
    assert sessions.drop_idle() == 1 and len(sessions) == 0
    assert sessions.dropped_idle == 1


def test_a_resent_request_gets_the_recorded_reply_again():
    """A client that lost a reply (its connection broke) resends the request: sampling again would fork
    the conversation from what the session recorded, so it gets the recorded turn."""
    engine = ScriptedEngine([turn("ab", -0.5), turn("c", -1.5)])
    sessions = sessions_on(engine)
    first = asyncio.run(sessions.reply("s", [USER], SAMPLING))
    assert asyncio.run(sessions.reply("s", [USER], SAMPLING)) is first and len(engine.requests) == 1
    history = [USER, {"role": "assistant", "content": "ab"}, USER]
    second = asyncio.run(sessions.reply("s", history, SAMPLING))
    assert asyncio.run(sessions.reply("s", history, SAMPLING)) is second and len(engine.requests) == 2
    with pytest.raises(SessionError, match="differs from what this session recorded"):  # only the last turn replays
        asyncio.run(sessions.reply("s", [USER], SAMPLING))


def test_a_session_dropped_as_idle_answers_410_naming_why_and_is_counted():
    settings = ChatEndpointConfig(enabled=True)
    sessions = sessions_on(ScriptedEngine([turn("ab", -0.5)]), settings=settings)
    asyncio.run(sessions.reply("s", [USER], SAMPLING))
    settings.session_idle_s = 0.0  # idle as soon as no request is in flight
    assert sessions.drop_idle() == 1
    assert sessions.tokens_dropped == len(turn("ab", -0.5)[0]), "its model tokens (EOS too) are work thrown away"
    history = [USER, {"role": "assistant", "content": "ab"}, USER]
    with pytest.raises(SessionError, match=r"session 's' is lost: dropped after 0s without a request "
                                           r"\(rollout.chat.session_idle_s\)") as error:
        asyncio.run(sessions.reply("s", history, SAMPLING))
    assert error.value.status == 410
    with pytest.raises(SessionError, match="is lost") as error:
        asyncio.run(sessions.close("s", 1.0))
    assert error.value.status == 410 and sessions.lost.refused == 2


def test_sessions_open_when_a_server_stops_are_lost_for_its_next_process(tmp_path):
    state = tmp_path / "server-1.chat_sessions.json"
    before = sessions_on(ScriptedEngine([turn("ab", -0.5)]), lost=LostSessions(state))
    for name in ("a", "b"):
        asyncio.run(before.reply(name, [USER], SAMPLING))
    asyncio.run(before.close("b", 1.0))
    after = sessions_on(ScriptedEngine([turn("ab", -0.5)]), lost=LostSessions(state))  # the restarted server
    with pytest.raises(SessionError, match="session 'a' is lost: the rollout server restarted") as error:
        asyncio.run(after.reply("a", [USER, {"role": "assistant", "content": "ab"}, USER], SAMPLING))
    assert error.value.status == 410 and after.lost.refused == 1
    with pytest.raises(SessionError, match="no open session 'b'"):  # closed before the restart: not lost
        asyncio.run(after.close("b", 1.0))
    asyncio.run(after.reply("c", [USER], SAMPLING))
    third = LostSessions(state)  # a second restart knows the sessions open in the process before it
    assert (third.why("c"), third.why("a")) == (RESTARTED, None)


def test_a_refused_first_request_holds_no_place():
    places = OpenPlaces()
    sessions = sessions_on(ScriptedEngine([turn("ab", -0.5)]), places=places)
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(SessionError, match="only text parts"):
        asyncio.run(sessions.reply("s", [image], SAMPLING))
    long = {"role": "user", "content": "x" * 300}  # past the 256-token context
    with pytest.raises(SessionError, match="at the context length") as error:
        asyncio.run(sessions.reply("s", [long], SAMPLING))
    assert error.value.status == 400 and (len(sessions), places.open) == (0, 0)


def test_a_close_waits_for_the_turn_being_answered():
    """A client may close as soon as it read a streamed reply's last chunk, before the turn is recorded."""
    sessions = sessions_on(ScriptedEngine([turn("ab", -0.5)]))

    async def close_during_the_last_write():
        listener = HeldAtTheEnd()
        answering = asyncio.create_task(sessions.reply("s", [USER], SAMPLING, listener=listener))
        await listener.finishing.wait()
        closing = asyncio.create_task(sessions.close("s", 1.0))
        await asyncio.sleep(0)  # one loop turn, no time: the close runs up to the session's lock
        listener.finish.set()
        await answering
        return await closing

    record_id, group = asyncio.run(close_during_the_last_write())
    (trajectory,) = group.trajectories
    assert trajectory.num_turns == 1 and trajectory.completion_ids == ids("ab") + [EOS]
