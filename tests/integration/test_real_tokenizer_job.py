"""Multi-turn episodes and chat sessions with a tiny model built on Qwen3's real tokenizer (model.tiny.tokenizer=qwen3):
vLLM loads the directory as any Qwen model, and across turns the ids the learner receives are the ids the engine
returned, each turn's request the ids so far, although the sampled turns re-tokenize to other ids: on an engine of the
test's own (agent-loop episodes, and a session driven through the chat endpoint by the official `openai` SDK: a
streamed call of the calculator forced in Qwen3's `<tool_call>` format and read by vLLM's hermes parser, the tool's
reply, the next turn), and in a whole job (a real job, run beside the other tests)."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import load_config
from asyncrl.config.rollout import ChatEndpointConfig, EngineConfig, RolloutConfig, SamplingConfig
from asyncrl.environments import ChatDelta
from asyncrl.environments.calculator_tool import ARGUMENT, FUNCTION_NAME, evaluate
from asyncrl.messages import Ack
from asyncrl.metrics import read_metrics
from asyncrl.thinking import OFF, Thinking
from demo.tiny.build import init_model
from rollout_servers.chat.admission import ChatAdmission
from rollout_servers.chat.endpoint import ChatEndpoint
from rollout_servers.chat.sessions import ChatSessions
from rollout_servers.chat.tools import ToolCallReader
from rollout_servers.rewards.builtin import scorer_for
from tests.integration.conftest import _KEPT_ALIVE, ENGINE_CPU_THREADS
from tests.integration.test_chat_openai import as_logged, model_tokens
from tests.integration.test_chat_run import chat_url, run_with_agents
from tests.integration.test_k0_matches_reference import consumed_groups
from tests.integration.test_rollout_multi_turn import (LOGPROB_TOLERANCE, MAX_MODEL_LEN, PLACE_WAIT_S, RecordingEngine,
                                                       check_episode_tokens, recomputed_logprobs, run_episode)
from run_helpers import asyncrl, prepare, tiny_job
from waiting import wait_until_async

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EPISODES = 3
CALCULATOR_STEPS = 3  # K = 0, 2 groups a step: the agent's session gets a place within the first steps
# Small and random (no warm start): what is tested is how ids travel, not what the model says.
QWEN3 = "model.tiny.tokenizer=qwen3"
SHAPE = [QWEN3, "model.tiny.hidden_size=64", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=128", "model.warm_start.steps=0",
         "model.warm_start.eval_samples=2"]


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, str]:
    directory = tmp_path_factory.mktemp("qwen3_tiny")
    init_model(load_config(None, [*SHAPE, f"model.path={directory}"]), scorer_for)
    return AutoTokenizer.from_pretrained(directory), AutoModelForCausalLM.from_pretrained(directory).eval(), str(directory)


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_model, loop_runner) -> Iterator[Any]:
    from rollout_servers.engine import RolloutEngine

    config = RolloutConfig(max_inflight=4, engine=EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN,
                                                               cpu_threads=ENGINE_CPU_THREADS))
    engine = loop_runner.run(RolloutEngine.start(qwen3_model[2], config))
    yield engine
    engine.shutdown()
    _KEPT_ALIVE.append(engine)  # see the shared engine's fixture: collected, vLLM's ZeroMQ contexts hang the exit


def model_turns(trajectory) -> list[list[int]]:
    """The runs of sampled ids (loss mask 1) of a multi-turn trajectory, turn by turn."""
    turns: list[list[int]] = []
    for position, (token, sampled) in enumerate(zip(trajectory.completion_ids, trajectory.loss_mask)):
        if sampled and (position == 0 or not trajectory.loss_mask[position - 1]):
            turns.append([])
        if sampled:
            turns[-1].append(token)
    return turns


def drifts(tokenizer, turn_ids: list[int]) -> bool:
    """Whether re-tokenizing the turn's text gives other ids than were sampled."""
    return tokenizer.encode(tokenizer.decode(turn_ids), add_special_tokens=False) != turn_ids


def test_episodes_on_the_real_tokenizer_train_the_ids_the_engine_returned(qwen3_engine, qwen3_model, loop_runner):
    tokenizer, model, _ = qwen3_model
    drifting = 0
    for seed in range(EPISODES):
        engine = RecordingEngine(qwen3_engine)
        episode = loop_runner.run(run_episode(engine, tokenizer, seed=100 + seed))
        assert episode.finish_reason == "env_done", episode.error
        check_episode_tokens(episode, engine, tokenizer, model)
        drifting += sum(drifts(tokenizer, completion.token_ids) for _, completion in engine.calls)
    assert drifting > 0  # the premise: re-tokenizing the turns' text would have changed the ids


CHAT_SAMPLING = SamplingConfig(temperature=1.0, max_tokens=24, n=1)
CALL_MAX_TOKENS = 64  # room for a forced call of the calculator: its tags, name and a short expression
QUESTION = {"role": "user", "content": "What is 63*43? Use the calculator."}
EMPTY_THINK_BLOCK = "<think>\n\n</think>\n\n"
# The calculator's function tool, its expression required and held to 8 characters: a random policy's forced string
# then ends well within the call's token cap.
CALCULATOR = {"type": "function", "function": {"name": FUNCTION_NAME, "parameters": {
    "type": "object", "properties": {ARGUMENT: {"type": "string", "maxLength": 8}}, "required": [ARGUMENT]}}}


async def sdk_session(base_url: str) -> tuple[list[Any], Any, list[dict[str, Any]], str]:
    """An agent written with the official SDK: a streamed first turn forced to call the calculator (one call), the
    tool's answer by the call's id, a plain second turn, the close. The stream's chunks, the second reply, the messages
    of the second request and the tool's answer."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    session = {"extra_body": {"session_id": "calc-1"}}
    stream = await client.chat.completions.create(
        model="tiny", messages=[QUESTION], tools=[CALCULATOR], tool_choice="required", parallel_tool_calls=False,
        stream=True, logprobs=True, max_tokens=CALL_MAX_TOKENS, seed=5, **session)
    chunks = [chunk async for chunk in stream]
    (call,) = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
    expression = json.loads(call.function.arguments)[ARGUMENT]
    answer = evaluate(expression)
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                {"role": "tool", "tool_call_id": call.id, "content": answer}]
    second = await client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR],
                                                  tool_choice="none", logprobs=True, seed=6, **session)
    await client.post("/sessions/calc-1/close", body={"reward": 1.0}, cast_to=object)
    await client.close()
    return chunks, second, messages, answer


def test_a_chat_session_driven_by_the_openai_sdk_trains_the_ids_the_engine_returned(qwen3_engine, qwen3_model,
                                                                                    loop_runner):
    """The recorded trajectory is the engine's ids turn by turn, the tool's reply the template's own tokens between
    them, and the client was shown exactly those tokens and log-probs."""
    tokenizer, _, _ = qwen3_model
    engine = RecordingEngine(qwen3_engine)
    sent: list[Any] = []

    async def sink(group):
        sent.append(group)
        return Ack(record_id=group.record_id, offset=len(sent) - 1)

    settings = ChatEndpointConfig(enabled=True, tool_parser="hermes")
    places = ChatAdmission(sessions_per_group=1)
    sessions = ChatSessions(engine, tokenizer, MAX_MODEL_LEN, settings, "server-0", places)
    endpoint = ChatEndpoint(sessions, CHAT_SAMPLING, "tiny", sink, ToolCallReader("hermes", tokenizer))

    async def serve_one_session():
        port = await endpoint.start(settings, 0)
        granting = asyncio.create_task(grant_one_group(places))
        try:
            return await sdk_session(f"http://127.0.0.1:{port}/v1")
        finally:
            granting.cancel()
            await endpoint.stop()

    chunks, second_reply, messages, answer = loop_runner.run(serve_one_session())
    (first_prompt, first), (second_prompt, second) = engine.calls
    (group,) = sent
    (trajectory,) = group.trajectories

    # what the client was shown: the call, parsed by vLLM's hermes parser, and every sampled token's log-prob
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [entry.logprob for entry in streamed] == first.logprobs
    assert [entry.token for entry in streamed] == [tokenizer.decode([token]) for token in first.token_ids]
    assert [entry.logprob for entry in second_reply.choices[0].logprobs.content] == second.logprobs
    assert shown_call(messages)["name"] == FUNCTION_NAME
    assert hermes_call(tokenizer, first.token_ids) == shown_call(messages)
    # the trajectory the learner would train: the engine's ids, each turn's request the ids so far
    chat = ChatDelta(tokenizer)
    assert first_prompt == trajectory.prompt_ids == chat.prompt_ids([QUESTION], [CALCULATOR])
    observation = chat.observation_ids(messages[2:], first.token_ids, [CALCULATOR])
    assert tokenizer.decode(observation).endswith(f"<tool_response>\n{answer}\n</tool_response><|im_end|>\n"
                                                  "<|im_start|>assistant\n")
    assert second_prompt == first_prompt + first.token_ids + observation
    assert trajectory.completion_ids == first.token_ids + observation + second.token_ids
    assert trajectory.loss_mask == [1] * len(first.token_ids) + [0] * len(observation) + [1] * len(second.token_ids)
    assert trajectory.behaviour_logprobs == first.logprobs + [0.0] * len(observation) + second.logprobs
    assert (trajectory.num_turns, trajectory.reward, group.record_id) == (2, 1.0, "server-0-chat-calc-1")
    # the premise: re-tokenizing the sampled turns' text would have given other ids
    assert drifts(tokenizer, first.token_ids) or drifts(tokenizer, second.token_ids)


def hermes_call(tokenizer, token_ids: list[int]) -> dict[str, Any]:
    """The call a turn holds in hermes' layout, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`: the grammar
    fixes the text, so the tags are Qwen3's single tokens or the same text in pieces, as the policy samples them."""
    text = tokenizer.decode(token_ids)
    assert text.startswith("<tool_call>") and "</tool_call>" in text, text
    return json.loads(text.removeprefix("<tool_call>").split("</tool_call>")[0])


def shown_call(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The call the client was shown (and sent back as the assistant message): its name and parsed arguments."""
    (call,) = messages[1]["tool_calls"]
    return {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}


async def grant_one_group(places) -> None:
    """The server loop's part: room for one group within the staleness bound, once the session asks."""
    await wait_until_async(places.wanted, PLACE_WAIT_S, "the session asking for a place")
    places.take_grants(1)


def qwen3_job(_: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """guess_number on a model of its own built on Qwen3's tokenizer (random, no warm start), K = 0, 2 steps: the
    finished run and its run directory. A real job (conftest.py), run beside the other tests."""
    overrides = tiny_job(tmp, 2, QWEN3, "model.warm_start.steps=0", "task.name=guess_number",
                         "task.guess_number.max_guesses=3", "environment.max_turns=3", "buffer.max_staleness=0",
                         "buffer.batch_groups=2", "rollout.sampling.n=2", "validation.every=0",
                         f"rollout.engine.max_model_len={MAX_MODEL_LEN}", f"model.tiny.max_position={MAX_MODEL_LEN}")
    prepare(tmp, overrides)
    return asyncrl("run", *overrides, "run.name=qwen3-turns"), tmp


@dataclass
class CalculatorChatRun:
    """A finished calculator job on Qwen3's tokenizer, and what its agent saw."""

    done: subprocess.CompletedProcess
    run_dir: Path
    model_dir: Path
    agent: dict[str, Any]  # the agent's chunks, second reply, messages and tool answer, or the error that stopped it


def forced_call_agent(chat_file: Path, run: subprocess.Popen, seen: dict[str, Any]) -> None:
    """`sdk_session` against the job's endpoint, in a thread of its own while the job runs."""
    url = chat_url(chat_file, run)
    if url is None:
        return
    try:
        seen.update(zip(("chunks", "second", "messages", "answer"), asyncio.run(sdk_session(url))))
    except Exception as error:  # shown by the test: a thread's exception would be lost
        seen["error"] = repr(error)


def calculator_chat_job(_: Path, tmp: Path) -> CalculatorChatRun:
    """The function-calling calculator (its episodes' tool listed by Qwen3's template, calls read by hermes) on a model
    of its own built on Qwen3's tokenizer (random, no warm start), with `rollout.thinking=off` and the chat endpoint
    on, K = 0, 3 steps; an agent forces a call through the endpoint meanwhile (the random policy never calls the tool
    on its own). A real job (conftest.py), run beside the other tests."""
    overrides = tiny_job(tmp, CALCULATOR_STEPS, QWEN3, "model.warm_start.steps=0", "task.name=calculator",
                         "task.calculator.tool_format=hermes", "environment.tool_parser=hermes",
                         "environment.max_turns=2", "rollout.thinking=off", "rollout.chat.enabled=true",
                         "rollout.chat.tool_parser=hermes", "buffer.max_staleness=0", "buffer.batch_groups=2",
                         "rollout.sampling.n=2", "validation.every=0", "data.max_prompt_length=192",
                         f"rollout.engine.max_model_len={MAX_MODEL_LEN}", f"model.tiny.max_position={MAX_MODEL_LEN}",
                         "run.name=qwen3-calculator")
    prepare(tmp, overrides)
    run_dir, seen = tmp / "runs" / "qwen3-calculator", {}
    returncode, stderr = run_with_agents(overrides, run_dir, [functools.partial(forced_call_agent, seen=seen)])
    return CalculatorChatRun(subprocess.CompletedProcess([], returncode, "", stderr), run_dir, tmp / "model", seen)


REAL_JOBS = [qwen3_job, calculator_chat_job]  # run side by side with other modules' jobs (conftest.py)


def test_a_job_on_the_real_tokenizer_trains_the_ids_its_engine_sampled(real_jobs):
    """guess_number (multi-turn whatever the model says: a random policy never calls the calculator's tool), K = 0,
    so step 1 trains samples of version 0, the model on disk: at every trained position the behaviour log-prob, which
    the engine reported for the id it sampled, is that model's log-prob of the trained id."""
    done, tmp_path = real_jobs[qwen3_job].result()
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "runs" / "qwen3-turns"
    first_step = read_metrics(run_dir)[0]
    trajectories = [t for group in consumed_groups(run_dir, first_step) for t in group.trajectories]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert trajectories and max(t.num_turns for t in trajectories) > 1
    for trajectory in trajectories:
        recomputed = recomputed_logprobs(model, trajectory.prompt_ids, trajectory.completion_ids)
        gaps = [abs(a - b) for a, b, m in zip(trajectory.behaviour_logprobs, recomputed, trajectory.loss_mask) if m]
        assert max(gaps) < LOGPROB_TOLERANCE
        assert set(trajectory.token_versions) == {0}
    assert any(drifts(tokenizer, turn) for t in trajectories for turn in model_turns(t))


def test_a_calculator_job_on_the_real_tokenizer_trains_the_forced_call_its_agent_was_shown(real_jobs):
    """The session's group, as the buffer stored it and a step trained it: the ids of both turns with the log-probs
    the client was shown, the call in hermes' layout, the tool's reply between the turns untrained, every
    generation cue followed by the empty think block of `rollout.thinking=off`; the job's own episodes list the tool."""
    job = real_jobs[calculator_chat_job].result()
    assert job.done.returncode == 0, job.done.stderr[-3000:]
    assert "error" not in job.agent and "chunks" in job.agent, job.agent

    trained = {group.record_id: (record["step"], group) for record in read_metrics(job.run_dir)
               for group in consumed_groups(job.run_dir, record)}
    step, group = trained["server-0-chat-calc-1"]
    (session,) = group.trajectories
    tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    streamed = [(entry.token, entry.logprob) for chunk in job.agent["chunks"] if chunk.choices and
                chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    second = [(entry.token, entry.logprob) for entry in job.agent["second"].choices[0].logprobs.content]
    assert model_tokens(session, tokenizer) == as_logged(streamed + second)
    observation_start = session.loss_mask.index(0)
    assert hermes_call(tokenizer, session.completion_ids[:observation_start]) == shown_call(job.agent["messages"])
    assert session.num_turns == 2
    observation = session.completion_ids[observation_start: observation_start + session.loss_mask[observation_start:].index(1)]
    off = ChatDelta(tokenizer, Thinking.for_tokenizer(OFF, tokenizer))
    assert observation == off.observation_ids(job.agent["messages"][2:], session.completion_ids[:observation_start],
                                              [CALCULATOR])
    assert session.prompt_ids == off.prompt_ids([QUESTION], [CALCULATOR])
    assert tokenizer.decode(session.prompt_ids + observation).count("<|im_start|>assistant\n" + EMPTY_THINK_BLOCK) == 2
    assert step == 1 + max(session.token_versions), "K = 0: trained at the step after the version that sampled it"
    episodes = [t for _, other in trained.values() for t in other.trajectories if other.record_id != group.record_id]
    assert episodes and all("<tools>" in tokenizer.decode(t.prompt_ids) for t in episodes)
