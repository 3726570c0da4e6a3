"""An agent written with the official `openai` SDK drives a running job (`asyncrl run`, chat endpoint on,
an API key from a file): streamed and plain replies are recorded exactly as the client saw them, forced calls
(the server's grammar through vLLM's structured outputs) end as calls of their tool's schema within a few tokens,
a tool call round trip (a forced call, the `tool` reply, the final answer) is one trajectory with the tool's
tokens masked, a client that leaves mid-stream can resend and go on, refused fields get a 400 naming them, a
missing or wrong key gets 401 and stores nothing, and the example agent (`examples/openai_agent.py`) runs end to
end. One job serves the module; the last test stops it and reads the buffer's log (only safe to open once the
buffer has stopped writing it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import numpy
import openai
import pytest

from asyncrl.config.buffer import BufferConfig
from asyncrl.environments import ChatDelta
from asyncrl.environments.calculator_tool import evaluate
from asyncrl.messages import TrajectoryGroup, decode
from buffer.log import SegmentLog
from run_helpers import RUN_TIMEOUT_S, kill_tree, tiny_job
from waiting import exited, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

API_KEY = "agent-key-0123"
TOTAL_STEPS = 100_000  # never reached: the module stops the job
REQUEST_TIMEOUT_S = 120  # one reply on the loaded 2-core box
STOP_TIMEOUT_S = 120
POLL_S = 0.2
USER = {"role": "user", "content": "2+3="}
NEXT = {"role": "user", "content": "4+1="}
MAX_MODEL_LEN = 256  # the tiny model's positions; room for a tool, its call and the tool's answer
EXAMPLE_AGENT = Path(__file__).resolve().parents[2] / "examples" / "openai_agent.py"


@dataclass
class Job:
    run: subprocess.Popen
    run_dir: Path
    model_dir: Path
    key_file: Path
    url: str

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S)

    def stop(self) -> None:
        """Kill the job: what it acknowledged is in the buffer's log already, and a graceful stop (tested in
        test_run_signals.py) would only cost time here."""
        kill_tree(self.run.pid)
        self.run.wait(STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_job_inputs):
    tmp = tmp_path_factory.mktemp("chat_openai")
    key_file = tmp / "chat.key"
    key_file.write_text(API_KEY + "\n")
    overrides = tiny_job(tiny_job_inputs, TOTAL_STEPS, "run.name=chat-sdk", "rollout.chat.enabled=true",
                         f"rollout.chat.api_key_file={key_file}", "validation.every=0", "buffer.batch_groups=2",
                         "buffer.max_staleness=1", "rollout.sampling.n=2", "rollout.max_inflight=4",
                         "rollout.chat.tool_parser=hermes", f"rollout.engine.max_model_len={MAX_MODEL_LEN}",
                         f"run.root_dir={tmp / 'runs'}")
    run_dir = tmp / "runs" / "chat-sdk"
    with open(tmp / "run.log", "w") as output:  # a file, not a pipe: nobody reads the job's progress lines
        run = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", *overrides], stdout=output,
                               stderr=subprocess.STDOUT)
    job = Job(run, run_dir, tiny_job_inputs / "model", key_file, "")
    try:
        chat_file = run_dir / "rollout" / "server-0.chat.json"
        wait_until(chat_file.exists, RUN_TIMEOUT_S, "the chat endpoint's address file", poll_s=POLL_S,
                   give_up=exited(run), context=lambda: (tmp / "run.log").read_text()[-3000:])
        job.url = json.loads(chat_file.read_text())["url"]
        yield job
    finally:
        job.stop()


def session(session_id: str) -> dict:
    return {"extra_body": {"session_id": session_id}}


def test_no_key_or_a_wrong_key_gets_401_and_stores_nothing(job):
    with pytest.raises(openai.AuthenticationError, match="wrong API key"):
        job.client("not-the-key").chat.completions.create(model="m", messages=[USER], **session("intruder"))
    response = httpx.post(f"{job.url}/chat/completions", json={"messages": [USER], "session_id": "intruder"},
                          timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 401 and "no API key" in response.json()["error"]["message"]
    response = httpx.post(f"{job.url}/sessions/intruder/close", json={"reward": 1.0}, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 401
    with pytest.raises(openai.NotFoundError, match="no open session 'intruder'"):  # never opened
        job.client().post("/sessions/intruder/close", body={"reward": 1.0}, cast_to=object)
    assert [model.id for model in job.client().models.list()] == [str(job.model_dir)]


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0.5), ("n", 2), ("response_format", {"type": "json_object"})])
def test_a_refused_field_gets_a_400_that_names_it(job, field, value):
    with pytest.raises(openai.BadRequestError) as error:
        job.client().chat.completions.create(model="m", messages=[USER], **{field: value}, **session("refused"))
    assert error.value.param == field and f"'{field}'" in error.value.message


def test_a_client_that_leaves_mid_stream_resends_and_goes_on(job):
    body = {"messages": [USER], "session_id": "leaver", "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{job.url}/chat/completions", json=body, headers=headers,
                      timeout=REQUEST_TIMEOUT_S) as response:
        for line in response.iter_lines():  # the role chunk, then leave
            if line.startswith("data: "):
                assert json.loads(line[len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
                break
    client = job.client()
    chunks = list(client.chat.completions.create(model="m", messages=[USER], stream=True, **session("leaver")))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    reply = client.chat.completions.create(model="m", messages=[USER, {"role": "assistant", "content": text}, NEXT],
                                           **session("leaver"))
    assert reply.choices[0].finish_reason in ("stop", "length")
    closed = client.post("/sessions/leaver/close", body={"reward": 0.0}, cast_to=object)
    assert closed["sent"] is True


def test_the_example_agent_trains_through_the_job(job):
    done = subprocess.run([sys.executable, str(EXAMPLE_AGENT), "--url", job.url, "--api-key-file", str(job.key_file),
                           "--questions", "1", "--group", "2", "--max-turns", "2"],
                          capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S * 4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"group sent to the buffer as server-0-chat-q-\w+ \(offset \d+\)", done.stdout), done.stdout
    assert "over 2 sessions" in done.stdout


def seen_turn_streamed(client: openai.OpenAI, messages: list, session_id: str) -> tuple[str, list[tuple[str, float]]]:
    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True, logprobs=True,
                                                 stream_options={"include_usage": True}, **session(session_id)))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[-1].choices
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    seen = [(entry.token, entry.logprob) for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
            for entry in chunk.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == len(seen)
    return text, seen


def seen_turn_plain(client: openai.OpenAI, messages: list, session_id: str) -> tuple[str, list[tuple[str, float]]]:
    reply = client.chat.completions.create(model="m", messages=messages, logprobs=True, **session(session_id))
    seen = [(entry.token, entry.logprob) for entry in reply.choices[0].logprobs.content]
    assert reply.usage.completion_tokens == len(seen)
    return reply.choices[0].message.content, seen


# Tools without `strict`: a forced call's arguments still follow their schema (only `"strict": false` frees them), so
# a model never taught to call them (this job's) closes its call within a few tokens. Their keys are in the order of
# vLLM's request model, which the server's prompt renders.
CALL_MAX_TOKENS = 96  # each tool's prompt is about 145 tokens: a call fits, then the tool's message and an answer
CALCULATOR = {"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string", "maxLength": 3}}}}}
SWITCH = {"type": "function", "function": {"name": "set", "parameters": {  # a required field
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}}


@dataclass
class ToolRoundTrip:
    offset: int  # where the buffer stored the session's group
    seen: list[tuple[str, float]]  # the model's tokens and log-probs as the client saw them, both turns
    tool_reply: str  # what the tool answered
    record_id: str  # the session's record id


def named(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


def forced_call(client: openai.OpenAI, tool: dict, tool_choice, session_id: str,
                seed: int = 0) -> openai.types.chat.ChatCompletion:
    """A first turn of session `session_id` offered `tool` and forced by `tool_choice` to make one call of it, within
    CALL_MAX_TOKENS. One call: with parallel calls allowed, `required`'s grammar takes call after call until the model
    samples its end, which the tiny model almost never does, so every try ran to its cap."""
    reply = client.chat.completions.create(model="m", messages=[USER], tools=[tool], tool_choice=tool_choice,
                                           parallel_tool_calls=False, logprobs=True, max_tokens=CALL_MAX_TOKENS,
                                           seed=seed, **session(session_id))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    return reply


@pytest.fixture(scope="module")
def tool_round_trip(job) -> ToolRoundTrip:
    """One session, while the job serves: the model calls the calculator (forced by naming the function: the
    tiny model of this job was never taught to call it), the agent answers with a `tool` message, the model
    answers, and the session is closed as a group of one."""
    client = job.client()
    session_id = "tools"
    first = forced_call(client, CALCULATOR, named(CALCULATOR), session_id)
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "calc"
    expression = json.loads(call.function.arguments).get("expr")  # an object, by the tool's schema
    tool_reply = evaluate(expression) if isinstance(expression, str) else "error"
    history = [USER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": tool_reply}]
    final = client.chat.completions.create(model="m", messages=history, tools=[CALCULATOR], tool_choice="none",
                                           logprobs=True, **session(session_id))
    closed = client.post(f"/sessions/{session_id}/close", body={"reward": 1.0}, cast_to=object)
    assert closed["sent"] is True
    seen = [(entry.token, entry.logprob) for reply in (first, final) for entry in reply.choices[0].logprobs.content]
    return ToolRoundTrip(closed["offset"], seen, tool_reply, closed["record_id"])


FORCED_TRIES = 4  # per tool and choice: 16 forced calls


@pytest.mark.parametrize("tool", [CALCULATOR, SWITCH], ids=["calc", "set"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_every_forced_call_ends_in_a_call_of_the_tools_schema(job, tool, choice):
    """The tiny model's free JSON is junk (`true`, a bare number), and a grammar that let free whitespace stand
    between JSON tokens let it fill its token cap with newlines inside the arguments. Forced, every call ends within
    a few tokens of its arguments, and its arguments are an object of the tool's schema (a required field of its
    type, a string within its length)."""
    client = job.client()
    tool_choice = "required" if choice == "required" else named(tool)
    for attempt in range(FORCED_TRIES):
        session_id = f"forced-{choice}-{tool['function']['name']}-{attempt}"
        reply = forced_call(client, tool, tool_choice, session_id, seed=attempt)
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == tool["function"]["name"]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        client.post(f"/sessions/{session_id}/close", body={"reward": 0.0}, cast_to=object)


def read_group(job: Job, offset: int) -> TrajectoryGroup:
    """The group the buffer stored at `offset`; only once the job is stopped (the service owns its log)."""
    log = SegmentLog(job.run_dir / "buffer", BufferConfig().segment_bytes, "none")
    try:
        return decode(log.read(offset), expect=TrajectoryGroup)
    finally:
        log.close()


def model_tokens(trajectory, tokenizer) -> list[tuple[str, float]]:
    return [(tokenizer.decode([token]), logprob) for token, logprob, mask in
            zip(trajectory.completion_ids, trajectory.behaviour_logprobs, trajectory.loss_mask) if mask]


def test_streamed_and_plain_replies_are_recorded_as_the_client_saw_them(job, tool_round_trip):
    """Runs last of those that use the job (the tool round trip included): it stops the job to read the buffer's
    log (the service owns it while it runs)."""
    client = job.client()
    seen_by = {}
    for session_id, turn in (("plain", seen_turn_plain), ("streamed", seen_turn_streamed)):
        text, seen = turn(client, [USER], session_id)
        more_text, more = turn(client, [USER, {"role": "assistant", "content": text}, NEXT], session_id)
        seen_by[session_id] = seen + more
    client.post("/sessions/plain/close", body={"reward": 0.5, "group_id": "pair", "group_size": 2}, cast_to=object)
    closed = client.post("/sessions/streamed/close", body={"reward": 0.5, "group_id": "pair", "group_size": 2},
                         cast_to=object)
    assert closed["sent"] is True and closed["record_id"] == "server-0-chat-pair"
    job.stop()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    group = read_group(job, closed["offset"])
    assert group.record_id == "server-0-chat-pair"
    for trajectory, session_id in zip(group.trajectories, ("plain", "streamed")):
        assert model_tokens(trajectory, tokenizer) == as_logged(seen_by[session_id]), session_id
        assert trajectory.num_turns == 2


def as_logged(seen: list[tuple[str, float]]) -> list[tuple[str, float]]:
    return [(token, float(numpy.float32(logprob))) for token, logprob in seen]  # the log keeps float32


def test_a_tool_call_round_trip_is_one_trajectory_with_the_tool_masked(job, tool_round_trip):
    """After the job stopped (the test above): the stored session, token by token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    group = read_group(job, tool_round_trip.offset)
    (trajectory,) = group.trajectories
    assert (group.record_id, trajectory.num_turns, trajectory.finish_reason) == (tool_round_trip.record_id, 2,
                                                                                "session_closed")
    chat = ChatDelta(tokenizer)
    assert trajectory.prompt_ids == chat.prompt_ids([USER], [CALCULATOR])  # the tool listed by the template
    # the trained ids are the exact ids sampled, as the client saw them, with their log-probs
    assert model_tokens(trajectory, tokenizer) == as_logged(tool_round_trip.seen)
    # the behaviour log-probs are those of the distribution that drew the tokens, after the grammar's mask:
    # "<tool_call>" is the only way a forced call can start, so each of its 11 characters had probability 1
    assert [logprob for _, logprob in tool_round_trip.seen[:11]] == [0.0] * 11
    # between the two model turns: the tool's message, rendered by the template, mask 0 (never trained)
    ids, mask = trajectory.completion_ids, trajectory.loss_mask
    first_turn = mask.index(0)
    tool_ids = ids[first_turn: first_turn + mask[first_turn:].index(1)]
    tool_message = {"role": "tool", "tool_call_id": "any", "content": tool_round_trip.tool_reply}
    assert tool_ids == chat.observation_ids([tool_message], ids[:first_turn], [CALCULATOR])
    assert f"<|im_start|>tool\n{tool_round_trip.tool_reply}<|im_end|>" in tokenizer.decode(tool_ids)
    assert mask == [1] * first_turn + [0] * len(tool_ids) + [1] * (len(ids) - first_turn - len(tool_ids))
    # the first turn is the call itself, in hermes' layout
    call_text = tokenizer.decode(ids[:first_turn])
    assert call_text.startswith("<tool_call>") and "</tool_call>" in call_text, call_text
    call_json = json.loads(call_text.removeprefix("<tool_call>").split("</tool_call>")[0])
    assert call_json["name"] == "calc" and isinstance(call_json["arguments"], dict), call_text
