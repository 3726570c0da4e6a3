"""The chat endpoint over HTTP on the scripted engine and the character tokenizer, read with the official
`openai` SDK and as raw server-sent events: the exact chunk sequence of a stream, streamed and
non-streamed turns record the same trajectory, a client that leaves mid-stream, and refused fields."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import socket
import threading
from pathlib import Path
from typing import Iterator

import httpx
import openai
import psutil
import pytest

from asyncrl.config.rollout import ChatEndpointConfig, SamplingConfig
from asyncrl.environments import ChatDelta
from asyncrl.messages import Ack
from asyncrl.transport.sockets import BufferRequestError
from rollout_servers.chat.auth import ApiKeyError
from rollout_servers.chat.endpoint import ChatEndpoint
from rollout_servers.chat.sessions import ChatSessions, SessionError
from rollout_servers.chat.stream import TextSteps
from rollout_servers.chat.tools import ToolCallReader
from tests.unit.rollout_servers.test_agent_loop import EOS, TOKENIZER, ScriptedEngine, ids, turn
from tests.unit.rollout_servers.test_call_grammar import follows
from tests.unit.rollout_servers.test_chat_sessions import USER, OpenPlaces
from waiting import wait_until, wait_until_async

SAMPLING = SamplingConfig(temperature=1.0, max_tokens=128, n=1)
DEADLINE_S = 10.0  # any wait on the endpoint's thread; nothing here takes more than milliseconds
EXAMPLE_AGENT = Path(__file__).resolve().parents[3] / "examples" / "openai_agent.py"


class Served:
    """A ChatEndpoint on its own event loop thread, and what it sent to the buffer."""

    def __init__(self, engine, settings: ChatEndpointConfig) -> None:
        self.engine = engine
        self.settings = settings
        self.sessions = ChatSessions(engine, TOKENIZER, 512, settings, "server-1", OpenPlaces())
        self.groups = []
        self.loop = asyncio.new_event_loop()
        tool_calls = ToolCallReader(settings.tool_parser, TOKENIZER) if settings.tool_parser else None
        self.endpoint = ChatEndpoint(self.sessions, SAMPLING, "tiny", self._sink, tool_calls)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _sink(self, group) -> Ack:
        self.groups.append(group)
        return Ack(record_id=group.record_id, offset=len(self.groups))

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(DEADLINE_S)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.endpoint.port}/v1"


@contextlib.contextmanager
def serving(engine, api_key: str | None = None, **settings) -> Iterator[Served]:
    served = Served(engine, ChatEndpointConfig(enabled=True, **settings))
    served.thread.start()
    try:
        served.call(served.endpoint.start(served.settings, 0, api_key))
        yield served
    finally:
        served.call(served.endpoint.stop())
        served.loop.call_soon_threadsafe(served.loop.stop)
        served.thread.join(DEADLINE_S)


def client(served: Served, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url, api_key=api_key, max_retries=0, timeout=DEADLINE_S)


def events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_stream_is_role_then_a_chunk_per_token_then_finish_usage_and_done():
    with serving(ScriptedEngine([turn("ab", -0.5)])) as served:
        body = {"messages": [USER], "session_id": "s", "stream": True, "logprobs": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{served.url}/chat/completions", json=body, timeout=DEADLINE_S) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            data = events(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(event) for event in data[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    deltas = [chunk["choices"][0]["delta"] if chunk["choices"] else None for chunk in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}, {"content": ""}, {}, None]
    logprobs = [[(entry["token"], entry["logprob"]) for entry in chunk["choices"][0]["logprobs"]["content"]]
                for chunk in chunks[1:4]]
    assert logprobs == [[("a", -0.5)], [("b", -0.625)], [("<|im_end|>", -0.75)]]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:5]] == [None] * 4 + ["stop"]
    prompt_tokens = len(served.engine.requests[0][0])
    assert chunks[5]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                  "total_tokens": prompt_tokens + 3}


def test_streamed_and_plain_turns_record_the_same_trajectory():
    script = [turn("ab", -0.5), turn("cd", -1.0)]
    trajectories = {}
    for stream in (False, True):
        with serving(ScriptedEngine(script)) as served:
            sdk = client(served)
            messages = [USER]
            for _ in script:
                if stream:
                    chunks = list(sdk.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                              logprobs=True, extra_body={"session_id": "s"}))
                    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
                    logprobs = [entry.logprob for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                                for entry in chunk.choices[0].logprobs.content]
                else:
                    reply = sdk.chat.completions.create(model="tiny", messages=messages, logprobs=True,
                                                        extra_body={"session_id": "s"})
                    text = reply.choices[0].message.content
                    logprobs = [entry.logprob for entry in reply.choices[0].logprobs.content]
                messages = [*messages, {"role": "assistant", "content": text}, USER]
                assert logprobs == served.engine.turns[len(served.engine.requests) - 1][1]
            sdk.post("/sessions/s/close", body={"reward": 1.0}, cast_to=object)
        (trajectories[stream],) = served.groups[0].trajectories
    assert trajectories[True] == trajectories[False]
    assert trajectories[True].completion_ids[:3] == ids("ab") + [EOS]


class WaitingEngine(ScriptedEngine):
    """Samples its first token, then waits until `proceed()` says so before sampling the rest."""

    def __init__(self, turns, proceed) -> None:
        super().__init__(turns)
        self.proceed = proceed
        self.aborted = 0

    async def generate(self, prompt_ids, sampling=None, *, on_tokens=None, **kwargs):
        async def slow(token_ids, logprobs):
            if len(token_ids) == 2:
                await wait_until_async(self.proceed, DEADLINE_S, "leave to sample on")
            await on_tokens(token_ids, logprobs)

        try:
            return await super().generate(prompt_ids, sampling, on_tokens=slow if on_tokens else None, **kwargs)
        except ConnectionError:
            self.aborted += 1
            raise


def test_a_client_leaving_mid_stream_leaves_the_session_as_before_and_usable():
    served_box: list[Served] = []

    def client_gone() -> bool:
        """The server has closed its end of the client's connection (it saw the client leave; its handler lives
        on meanwhile): this process holds no socket on the endpoint's port but the listening one."""
        port = served_box[0].endpoint.port
        return not any(c.laddr and c.laddr.port == port and c.status != psutil.CONN_LISTEN
                       for c in psutil.Process().net_connections("tcp"))

    with serving(WaitingEngine([turn("abcd", -0.5)], client_gone)) as served:
        served_box.append(served)
        body = {"messages": [USER], "session_id": "t", "stream": True}
        with httpx.stream("POST", f"{served.url}/chat/completions", json=body, timeout=DEADLINE_S) as response:
            seen = []
            for line in response.iter_lines():  # read the role and the first token, then leave
                if line.startswith("data: "):
                    seen.append(json.loads(line[len("data: "):])["choices"][0]["delta"])
                if len(seen) == 2:
                    break
        assert seen == [{"role": "assistant", "content": ""}, {"content": "a"}]
        wait_until(lambda: served.engine.aborted, DEADLINE_S, "the turn's request stopped when the client left")
        assert served.engine.aborted == 1
        with pytest.raises(SessionError, match="no model turn"):  # nothing recorded for the lost reply
            served.call(served.sessions.close("t", 1.0))
        reply = client(served).chat.completions.create(model="tiny", messages=[USER], extra_body={"session_id": "t"})
        assert reply.choices[0].message.content == "abcd"
        _, group = served.call(served.sessions.close("t", 1.0))
    (trajectory,) = group.trajectories
    assert trajectory.num_turns == 1 and trajectory.completion_ids == ids("abcd") + [EOS]


@pytest.mark.parametrize("extra, field", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"n": 2}, "n"),
    ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},  # names no tool that was sent
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ({"temperature": "hot"}, "temperature"),
    ({"reward_hint": 1}, "reward_hint"),
    ({"session_id": None}, "session_id"),
    ({"messages": []}, "messages"),
])
def test_a_refused_field_gets_a_400_that_names_it_and_opens_nothing(extra, field):
    with serving(ScriptedEngine([turn("ab", -0.5)])) as served:
        body = {"model": "tiny", "messages": [USER], "session_id": "s", "user": "me", **extra}
        response = httpx.post(f"{served.url}/chat/completions", json=body, timeout=DEADLINE_S)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and f"'{field}'" in error["message"]
        assert len(served.sessions) == 0 and not served.engine.requests


def test_the_sdk_sees_refusals_as_bad_requests():
    with serving(ScriptedEngine([turn("ab", -0.5)])) as served:
        with pytest.raises(openai.BadRequestError, match="presence_penalty"):
            client(served).chat.completions.create(model="tiny", messages=[USER], presence_penalty=1.0,
                                                   extra_body={"session_id": "s"})


def test_a_group_the_buffer_refuses_gets_a_502_that_names_the_record_and_the_reason():
    with serving(ScriptedEngine([turn("ab", -0.5)])) as served:
        async def refusing_sink(group) -> Ack:
            raise BufferRequestError(f"buffer at tcp://x rejected record {group.record_id}: too large")

        served.endpoint._sink = refusing_sink
        client(served).chat.completions.create(model="tiny", messages=[USER], extra_body={"session_id": "s"})
        response = httpx.post(f"{served.url}/sessions/s/close", json={"reward": 1.0}, timeout=DEADLINE_S)
        assert response.status_code == 502, response.text
        message = response.json()["error"]["message"]
        assert "server-1-chat-s" in message and "too large" in message


def test_without_the_api_key_every_route_is_refused_with_401_and_nothing_is_stored():
    with serving(ScriptedEngine([turn("ab", -0.5)]), api_key="sesame") as served:
        sdk = client(served, api_key="guess")
        with pytest.raises(openai.AuthenticationError, match="wrong API key"):
            sdk.chat.completions.create(model="tiny", messages=[USER], extra_body={"session_id": "s"})
        with pytest.raises(openai.AuthenticationError, match="wrong API key"):
            sdk.models.list()
        body = {"messages": [USER], "session_id": "s"}
        for route, headers, said in (("chat/completions", {}, "no API key"), ("sessions/s/close", {}, "no API key"),
                                     ("chat/completions", {"Authorization": "sesame"}, "wrong API key")):  # not as a bearer token
            response = httpx.post(f"{served.url}/{route}", json=body, headers=headers, timeout=DEADLINE_S)
            assert response.status_code == 401, route
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and said in error["message"]
        assert len(served.sessions) == 0 and not served.engine.requests and not served.groups

        sdk = client(served, api_key="sesame")
        reply = sdk.chat.completions.create(model="tiny", messages=[USER], extra_body={"session_id": "s"})
        assert reply.choices[0].message.content == "ab"
        sdk.post("/sessions/s/close", body={"reward": 1.0}, cast_to=object)
        assert len(served.groups) == 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("api_key", [None, ""])
def test_a_non_loopback_host_without_a_key_is_refused_before_listening(api_key):
    """The config refuses this host when it is loaded; an endpoint built without the config's checks refuses it
    when it binds, as the buffer's sockets refuse a non-loopback host without CURVE keys."""
    served = Served(ScriptedEngine([]), ChatEndpointConfig(enabled=True, host="0.0.0.0"))
    served.thread.start()
    port = free_port()
    try:
        with pytest.raises(ApiKeyError, match=r"rollout\.chat\.host: refusing to listen on non-loopback '0\.0\.0\.0' "
                                              r"without an API key; set rollout\.chat\.api_key_file"):
            served.call(served.endpoint.start(served.settings, port, api_key))
        with pytest.raises(ConnectionRefusedError):  # nothing listens, on any interface
            socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S).close()
    finally:
        served.call(served.endpoint.stop())
        served.loop.call_soon_threadsafe(served.loop.stop)
        served.thread.join(DEADLINE_S)


def test_with_a_key_the_endpoint_listens_on_any_host():
    with serving(ScriptedEngine([turn("ab", -0.5)]), api_key="sesame", host="0.0.0.0") as served:
        reply = client(served, api_key="sesame").chat.completions.create(model="tiny", messages=[USER],
                                                                         extra_body={"session_id": "s"})
        assert reply.choices[0].message.content == "ab"


TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two integers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                         "b": {"type": "integer"}}}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_a_tool_call_round_trip_keeps_the_sampled_ids_and_masks_the_tool_answer():
    with serving(ScriptedEngine([turn(CALL, -0.5), turn("5", -1.0)]), tool_parser="hermes") as served:
        sdk = client(served)
        first = sdk.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, extra_body={"session_id": "s"})
        choice = first.choices[0]
        (call,) = choice.message.tool_calls
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        assert (call.function.name, json.loads(call.function.arguments), call.type) == ("add", {"a": 2, "b": 3}, "function")
        assert call.id
        answer = {"role": "tool", "tool_call_id": call.id, "content": "5"}
        history = [USER, choice.message.model_dump(exclude_none=True), answer]
        wrong = {**answer, "tool_call_id": "call-nobody-made"}
        response = httpx.post(f"{served.url}/chat/completions", timeout=DEADLINE_S,
                              json={"messages": [*history[:2], wrong], "tools": TOOLS, "session_id": "s"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages[2].tool_call_id"
        response = httpx.post(f"{served.url}/chat/completions", timeout=DEADLINE_S,
                              json={"messages": history, "tools": TOOLS[:0] or None, "session_id": "s"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
        second = sdk.chat.completions.create(model="tiny", messages=history, tools=TOOLS, extra_body={"session_id": "s"})
        assert (second.choices[0].message.content, second.choices[0].finish_reason) == ("5", "stop")
        sdk.post("/sessions/s/close", body={"reward": 1.0}, cast_to=object)

    (trajectory,) = served.groups[0].trajectories
    assert trajectory.prompt_ids == ChatDelta(TOKENIZER).prompt_ids([USER], TOOLS) == served.engine.requests[0][0]
    answer_ids = ids("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    assert trajectory.completion_ids == ids(CALL) + [EOS] + answer_ids + ids("5") + [EOS], "the ids as sampled"
    assert trajectory.loss_mask == [1] * (len(ids(CALL)) + 1) + [0] * len(answer_ids) + [1] * 2


def test_a_streamed_tool_call_comes_whole_in_one_delta():
    with serving(ScriptedEngine([turn(CALL, -0.5), turn("5", -0.5)]), tool_parser="hermes") as served:
        body = {"messages": [USER], "session_id": "s", "stream": True, "tools": TOOLS}
        with httpx.stream("POST", f"{served.url}/chat/completions", json=body, timeout=DEADLINE_S) as response:
            data = events(response)
        chunks = [json.loads(event)["choices"][0] for event in data[:-1]]
        assert data[-1] == "[DONE]" and len(chunks) == 3
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        (call,) = chunks[1]["delta"]["tool_calls"]
        assert (call["index"], call["type"], call["function"]) == (0, "function", {"name": "add", "arguments": '{"a": 2, "b": 3}'})
        assert call["id"] and chunks[1]["delta"].get("content") is None
        assert (chunks[2]["delta"], chunks[2]["finish_reason"]) == ({}, "tool_calls")
        reply = {"role": "assistant", "content": None, "tool_calls": [{k: call[k] for k in ("id", "type", "function")}]}
        answer = {"role": "tool", "tool_call_id": call["id"], "content": "5"}  # the streamed id is the recorded one
        response = httpx.post(f"{served.url}/chat/completions", timeout=DEADLINE_S,
                              json={**body, "stream": False, "messages": [USER, reply, answer]})
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "5"


TWO_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}]


def forced_turn(served: Served, session: str = "s", **fields) -> openai.types.chat.ChatCompletion:
    return client(served).chat.completions.create(model="tiny", messages=[USER], tools=TWO_TOOLS,
                                                  extra_body={"session_id": session}, **fields)


MUL = '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'


def test_required_and_a_named_function_force_a_call_under_the_servers_grammar():
    with serving(ScriptedEngine([turn(CALL, -0.5)]), tool_parser="hermes") as served:
        required = forced_turn(served, tool_choice="required").choices[0]
        named = forced_turn(served, tool_choice={"type": "function", "function": {"name": "add"}},
                            session="t").choices[0]
        for choice in (required, named):
            (call,) = choice.message.tool_calls
            assert (choice.finish_reason, choice.message.content, call.function.name) == ("tool_calls", None, "add")
        required_grammar, named_grammar = (constraint.grammar for constraint in served.engine.constraints)
        assert follows(required_grammar, CALL) and follows(required_grammar, MUL)
        assert follows(named_grammar, CALL) and not follows(named_grammar, MUL)
        client(served).post("/sessions/s/close", body={"reward": 1.0}, cast_to=object)
    (trajectory,) = served.groups[0].trajectories
    assert trajectory.completion_ids == ids(CALL) + [EOS]  # the constrained ids as sampled, trained as they are


def test_a_forced_call_of_a_tool_whose_parameters_cannot_be_a_grammar_gets_a_400_naming_them():
    broken = {"type": "function", "function": {"name": "when", "parameters": {"type": "moment"}}}
    with serving(ScriptedEngine([turn(CALL, -0.5)]), tool_parser="hermes") as served:
        with pytest.raises(openai.BadRequestError, match="tool 'when'") as error:
            client(served).chat.completions.create(model="tiny", messages=[USER], tools=[*TOOLS, broken],
                                                   tool_choice="required", extra_body={"session_id": "s"})
        assert error.value.param == "tools[1].function.parameters"
        assert len(served.sessions) == 0 and not served.engine.requests


TWO_CALLS = MUL + "\n" + CALL


def test_auto_is_free_and_parallel_calls_false_shows_the_first_call_keeping_the_sampled_ids_whole():
    with serving(ScriptedEngine([turn(TWO_CALLS, -0.5)]), tool_parser="hermes") as served:
        first = forced_turn(served, parallel_tool_calls=False).choices[0]
        assert [c.function.name for c in first.message.tool_calls] == ["mul"]  # as vLLM's server shows it
        forced_turn(served, session="free")
        assert served.engine.constraints == [None, None]  # the model chose to call: no grammar either way
        client(served).post("/sessions/s/close", body={"reward": 1.0}, cast_to=object)
    assert served.groups[0].trajectories[0].completion_ids == ids(TWO_CALLS) + [EOS]


def test_tools_without_a_tool_parser_get_a_400():
    with serving(ScriptedEngine([turn("ab", -0.5)])) as served:
        with pytest.raises(openai.BadRequestError, match="rollout.chat.tool_parser") as error:
            client(served).chat.completions.create(model="tiny", messages=[USER], tools=TOOLS,
                                                   extra_body={"session_id": "s"})
        assert error.value.param == "tools"
        reply = client(served).chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice="none",
                                                       extra_body={"session_id": "s"})
        assert reply.choices[0].message.content == "ab"  # "none": rendered for the model, nothing parsed


def test_the_example_agent_calls_its_tool_and_scores_its_answer():
    spec = importlib.util.spec_from_file_location("openai_agent", EXAMPLE_AGENT)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "37+58"}}</tool_call>'
    sent = []  # the body of each request the agent makes

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    with serving(ScriptedEngine([turn(call, -0.5), turn("95", -0.5)]), tool_parser="hermes") as served:
        recording = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=DEADLINE_S,
                                  http_client=httpx.Client(event_hooks={"request": [record]}))
        assert agent.episode(recording, "37+58=", "95", "s", max_turns=3) == 1.0
        _, group = served.call(served.sessions.close("s", 1.0))
    assert group.trajectories[0].num_turns == 2  # both replies recorded
    assert len(sent) == 2  # the tool call, then the answer
    messages = sent[-1]["messages"]  # the whole conversation, as the session must have recorded it to accept it
    assert [message["role"] for message in messages] == ["user", "assistant", "tool"]
    assert messages[2]["content"] == "95" and messages[2]["tool_call_id"] == messages[1]["tool_calls"][0]["id"]


def test_streamed_text_waits_for_a_character_split_across_tokens():
    steps = TextSteps(lambda ids: bytes(ids).decode("utf-8", errors="replace"))  # a byte per token
    reply = list("aé b".encode())  # "é" is two bytes: 0xC3 0xA9
    assert [steps.step(reply[:count]) for count in range(1, len(reply) + 1)] == ["a", None, "é", " ", "b"]
    assert (steps.text, steps.tokens, steps.rest("aé b", len(reply))) == ("aé b", len(reply), "")
    ended = TextSteps(lambda ids: bytes(ids).decode("utf-8", errors="replace"))  # the reply ends while one waits
    assert (ended.step(reply[:1]), ended.step(reply[:2])) == ("a", None)
    assert ended.rest("aé b", len(reply)) == "é b"
