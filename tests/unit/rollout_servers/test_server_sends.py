"""A rollout server has one path to its buffer, for prompt groups and chat groups alike: a send the buffer does not
answer is made again (the learner is away), and the server's leaving waits for sends still running."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import pytest

from asyncrl.messages import Ack, TrajectoryGroup
from asyncrl.transport import BufferTimeout
from rollout_servers.buffer_calls import BufferCalls, ServerStopping
from rollout_servers.learner_wait import LearnerWait
from tests.unit.rollout_servers.test_agent_loop import ScriptedEngine, turn
from tests.unit.rollout_servers.test_chat_sessions import USER, OpenPlaces
from tests.unit.rollout_servers.test_server_groups import build_server

WAIT_S = 10.0  # any HTTP exchange or thread hand-over here takes milliseconds


class UnansweredFirst:
    """The buffer's producer as a server sees it while the learner is away: the first send is never acknowledged
    (BufferTimeout), the next is."""

    def __init__(self) -> None:
        self.attempts: list[str] = []  # record id of each send, in order

    def send(self, group: TrajectoryGroup) -> Ack:
        self.attempts.append(group.record_id)
        if len(self.attempts) == 1:
            raise BufferTimeout(f"record {group.record_id} not acknowledged")
        return Ack(group.record_id, offset=41)


async def chat_session_closed(endpoint_port: int) -> httpx.Response:
    """One turn of session "s", then its close with a reward; the close's answer."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{endpoint_port}/v1", timeout=WAIT_S) as client:
        reply = await client.post("/chat/completions", json={"model": "tiny", "messages": [USER], "session_id": "s"})
        assert reply.status_code == 200, reply.text
        return await client.post("/sessions/s/close", json={"reward": 1.0})


@pytest.fixture
def chat_server(tmp_path, monkeypatch):
    monkeypatch.setattr("rollout_servers.server.ChatAdmission", lambda sessions_per_group: OpenPlaces())
    return build_server(tmp_path, "arithmetic", "rollout.chat.enabled=true")


def test_a_chat_group_the_buffer_did_not_answer_is_sent_again_like_a_prompt_group(chat_server):
    producer = UnansweredFirst()

    async def scenario() -> httpx.Response:
        endpoint = await chat_server._start_chat(ScriptedEngine([turn("ab", -0.5)]), producer)
        try:
            return await chat_session_closed(endpoint.port)
        finally:
            await endpoint.stop()

    closed = asyncio.run(scenario())
    assert closed.status_code == 200, closed.text
    assert (closed.json()["sent"], closed.json()["offset"]) == (True, 41)
    assert producer.attempts == ["server-0-chat-s"] * 2, "the same record, sent again after the unanswered send"


def test_a_request_the_buffer_did_not_answer_is_made_again_and_the_wait_reported_once(caplog):
    producer, calls = UnansweredFirst(), BufferCalls(LearnerWait("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", None))
    group = TrajectoryGroup("r-1", "g", "server-0", [])
    try:
        with caplog.at_level(logging.INFO, logger="rollout_servers.learner_wait"):
            ack = asyncio.run(calls.call(producer.send, group))
    finally:
        calls.close()
    assert ack == Ack("r-1", offset=41) and producer.attempts == ["r-1", "r-1"]
    assert caplog.text.count("waiting for the learner") == 1 and caplog.text.count("answers again") == 1


def test_stopping_waits_for_a_request_still_running_and_then_makes_no_new_one():
    calls = BufferCalls(LearnerWait("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", None))
    started, release, done = threading.Event(), threading.Event(), []

    def slow_send(record_id: str) -> str:
        started.set()
        release.wait(WAIT_S)
        done.append(record_id)
        return record_id

    async def scenario() -> tuple[bool, list[str]]:
        sending = asyncio.create_task(calls.call(slow_send, "r-1"))
        await asyncio.to_thread(started.wait, WAIT_S)
        sending.cancel()  # as a stopped server cancels its groups: the request's thread still runs
        stopping = asyncio.create_task(calls.stop(WAIT_S))
        await asyncio.sleep(0.2)  # the behaviour under test: the stop is still waiting
        stopped_early = stopping.done()
        release.set()
        await stopping
        with pytest.raises(ServerStopping, match="the server is leaving"):
            await calls.call(slow_send, "r-2")
        return stopped_early, done

    try:
        stopped_early, done = asyncio.run(scenario())
    finally:
        calls.close()
    assert not stopped_early, "the stop returned while r-1 was still being sent"
    assert done == ["r-1"], "r-2 was never made"
