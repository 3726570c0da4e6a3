"""How a rollout server turns one prompt into one acknowledged group (`GroupSampler.sample`), with the
engine, scorer and buffer producer stood in: a group runs to its end, however many weight updates it spans,
and is sent once under the prompt's record id with the learner version it started under; each sample frees
its slot of the server's capacity as it finishes, not when its whole group does; the start gate applies the
staleness rule; open chat sessions count against admission (`AdmissionAsks`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.config import load_config
from asyncrl.config.rollout import RolloutConfig
from asyncrl.data import write_rows
from asyncrl.messages import Ack, AdmissionGrant, Trajectory, TrajectoryGroup
from learner.maths.staleness import staleness_metrics
from rollout_servers.rewards import RewardFunctionError, RewardResult
from rollout_servers.rewards.builtin import UnknownDataSourceError
from demo.tiny.tokenizer import build_char_tokenizer
from buffer.admission import Admission
from rollout_servers.admission_asks import AdmissionAsks
from rollout_servers.chat.admission import ChatAdmission
from rollout_servers.completion import Completion
from rollout_servers.engine import RolloutEngine
from rollout_servers.sample_slots import SampleSlots
from rollout_servers.learner_wait import Endpoints
from rollout_servers.server import RolloutServer
from rollout_servers.start_gate import StartGate
from waiting import wait_until_async

N = 2  # samples per group
REWARD = 0.75
WAIT_S = 5.0  # for what takes a few event-loop turns, with slack for a loaded box
CAPACITY = 8  # samples a server generates at once (rollout.max_inflight)
SPANNED = [3, 4, 5, 6, 7]  # versions a long group's tokens were sampled by: four weight updates landed meanwhile


@dataclass
class LongEngine:
    """Samples every group as one long response per sample that spans several weight updates."""

    slots: SampleSlots
    seeds: list[int | None] = field(default_factory=list)
    slots_held: list[int] = field(default_factory=list)  # slots in use when each group began

    async def generate_group(self, prompt_ids, sampling=None, *, seed=None, on_sample_done=None) -> list[Completion]:
        self.seeds.append(seed)
        self.slots_held.append(self.slots.in_use)
        for _ in range(N):
            on_sample_done()
        tokens = list(range(10, 10 + len(SPANNED)))
        return [Completion(f"r{i}", list(prompt_ids), tokens, [-0.5] * len(SPANNED), list(SPANNED), "length")
                for i in range(N)]


class SingleTurn:
    def handles(self, data_source: str) -> bool:
        return False


@dataclass
class LongAgent:
    """A multi-turn agent loop whose episodes are the engine's long samples."""

    engine: LongEngine

    def handles(self, data_source: str) -> bool:
        return True

    async def run_group(self, row, sampling, seed, group_id, on_sample_done=None) -> list[Trajectory]:
        completions = await self.engine.generate_group([1], sampling, seed=seed, on_sample_done=on_sample_done)
        return [Trajectory([1], c.token_ids, c.logprobs, c.versions, [1] * len(c.token_ids), REWARD, group_id,
                           row.data_source, c.finish_reason) for c in completions]


class FixedScorer:
    async def score_async(self, requests) -> list[RewardResult]:
        return [RewardResult(REWARD) for _ in requests]


@dataclass
class RecordingProducer:
    sent: list[TrajectoryGroup] = field(default_factory=list)

    async def send(self, group: TrajectoryGroup) -> Ack:
        self.sent.append(group)
        return Ack(group.record_id, offset=len(self.sent) - 1)


def build_server(tmp_path: Path, data_source: str = "arithmetic", *overrides: str) -> RolloutServer:
    tokenizer_dir = tmp_path / "tokenizer"
    build_char_tokenizer().save_pretrained(tokenizer_dir)
    rows = [{"prompt": [{"role": "user", "content": "1+1"}], "data_source": data_source,
             "reward_model": {"ground_truth": "2", "style": "rule"}}]
    data = write_rows(rows, tmp_path / "train.jsonl")
    config = load_config(None, [f"model.path={tokenizer_dir}", f"data.train_files=[{data}]", "data.weights=[1.0]",
                                "validation.every=0", f"rollout.sampling.n={N}", *overrides])
    return RolloutServer(config, 0, Endpoints(buffer="tcp://127.0.0.1:1", sync="tcp://127.0.0.1:2"))


@pytest.fixture
def server(tmp_path: Path) -> RolloutServer:
    return build_server(tmp_path)


def test_a_server_with_data_no_scorer_handles_or_a_missing_reward_function_fails_when_built(tmp_path):
    # before its engine starts: the supervisor then reports it instead of restarting it (exit code 3)
    with pytest.raises(UnknownDataSourceError, match="no built-in scorer for data_source 'trivia'"):
        build_server(tmp_path, "trivia")
    missing = tmp_path / "missing_reward.py"
    with pytest.raises(RewardFunctionError, match="missing_reward.py"):
        build_server(tmp_path, "trivia", f"reward.custom_fn.path={missing}")


def sample_long_group(server, multi_turn: bool, learner_version: int) -> tuple:
    """One long group sampled through weight updates, by one agent or the other: (the group sent, engine, slots)."""
    slots = SampleSlots(CAPACITY)
    engine, producer = LongEngine(slots), RecordingProducer()
    agent = LongAgent(engine) if multi_turn else SingleTurn()
    asyncio.run(server.groups.sample(engine, agent, FixedScorer(), slots.claim(N), producer.send,
                                     learner_version=learner_version))
    (group,) = producer.sent
    return group, engine, slots


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_a_long_group_runs_to_its_end_through_updates_and_is_sent_once_with_its_start(server, multi_turn):
    group, engine, slots = sample_long_group(server, multi_turn, learner_version=3)
    assert group.record_id == group.group_id == "server-0-prompt-0"
    assert group.learner_version_at_start == 3 and group.oldest_version() == 3
    assert [t.token_versions for t in group.trajectories] == [SPANNED] * N, "every token, each with its own version"
    assert all(t.reward == REWARD and t.finish_reason == "length" for t in group.trajectories)
    assert len(engine.seeds) == 1 and server.stats.groups_sent == 1, "sampled once"
    assert engine.slots_held == [N] and slots.in_use == 0
    assert server.prompts.owed == 0, "the prompt is acknowledged: a restart does not regenerate it"


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_a_group_started_with_weights_newer_than_its_admission_answer_starts_under_them(server, multi_turn):
    # the learner sent version 3 before the buffer heard of it: the server's last answer still named 2
    group, _, _ = sample_long_group(server, multi_turn, learner_version=2)
    assert group.learner_version_at_start == SPANNED[0] == 3
    assert staleness_metrics([group], version=8)["staleness/start_lag_max"] == 0.0, "no group starts ahead of the learner"


FINISHED_TOKENS, PARTIAL_TOKENS = 3, 7  # the cut group's sample that finished, and what the other had sampled


class CutLLM:
    """Stands in for AsyncLLM: the first request samples FINISHED_TOKENS and ends; the others have sampled
    PARTIAL_TOKENS (as vLLM's output processor counts them) and wait until their reader is cancelled."""

    model_config = SimpleNamespace(quantization=None)

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.output_processor = SimpleNamespace(request_states={}, external_req_ids={})

    async def generate(self, prompt: dict, params, request_id: str, lora_request=None):
        self.requests.append(request_id)
        if len(self.requests) == 1:
            tokens = list(range(5, 5 + FINISHED_TOKENS))
            logprobs = [{token: SimpleNamespace(logprob=-0.5)} for token in tokens]
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reason="stop")])
            return
        sampled = SimpleNamespace(num_output_tokens=lambda: PARTIAL_TOKENS)
        self.output_processor.request_states[request_id] = SimpleNamespace(detokenizer=sampled)
        await asyncio.Event().wait()
        yield  # never reached: an async generator, like AsyncLLM.generate


def test_a_group_cut_short_by_the_servers_stop_counts_every_token_it_had_sampled_as_thrown_away(server):
    llm = CutLLM()
    engine = RolloutEngine(llm, RolloutConfig(), version=0)
    slots, producer = SampleSlots(CAPACITY), RecordingProducer()

    async def stop_mid_group() -> None:
        sampling = asyncio.create_task(server.groups.sample(engine, SingleTurn(), FixedScorer(), slots.claim(N),
                                                            producer.send, learner_version=0))
        await wait_until_async(lambda: engine.inflight_requests == 1 and len(llm.requests) == N, WAIT_S,
                               "one sample finished, the other sampling")
        sampling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sampling

    asyncio.run(stop_mid_group())
    assert producer.sent == [] and server.stats.tokens_cut == FINISHED_TOKENS + PARTIAL_TOKENS
    assert server._telemetry(engine).thrown_away_tokens == FINISHED_TOKENS + PARTIAL_TOKENS, "reported to the learner"
    assert slots.in_use == 0


def grant(learner_version: int, k: int, granted: int = 0) -> AdmissionGrant:
    return AdmissionGrant(granted, policy_version=learner_version, max_staleness=k)


def weights(version: int, needs_catch_up: bool = False) -> SimpleNamespace:
    return SimpleNamespace(current_version=version, needs_catch_up=needs_catch_up)


def test_the_start_gate_starts_groups_only_from_weights_within_k_of_the_learner():
    gate = StartGate(owed=2)  # a restarted server owes two groups from its previous process
    assert gate.release(grant(9, 2), weights(0)) == 0, "a fresh engine (version 0) against learner 9: lagging"
    gate.admit(3)
    assert gate.release(grant(9, 2), weights(6)) == 0 and gate.waiting == 5  # 9 - 6 = 3 > K = 2
    assert gate.release(grant(9, 2), weights(9, needs_catch_up=True)) == 0, "a failed update: mixed weights"
    assert gate.release(grant(9, 2), weights(7)) == 5 and gate.waiting == 0  # 9 - 7 = 2 = K
    assert not gate.is_open(grant(1, 0), weights(0)) and gate.is_open(grant(1, 0), weights(1))  # K = 0
    gate.admit(1)
    assert gate.release(grant(12, 4), weights(8)) == 1, "the K of the newest grant decides"


@dataclass
class StaggeredEngine:
    """Finishes a group's first sample at once and the others only when `release` is set."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    finished: int = 0  # samples done so far

    async def generate_group(self, prompt_ids, sampling=None, *, seed=None, on_sample_done=None) -> list[Completion]:
        async def sample(index: int) -> Completion:
            if index:
                await self.release.wait()
            on_sample_done()
            self.finished += 1
            return Completion(f"r{index}", list(prompt_ids), [7], [-0.5], [0], "stop")

        return list(await asyncio.gather(*(sample(i) for i in range(N))))


def test_a_finished_sample_frees_its_slot_while_its_group_still_generates(server):
    slots, engine, producer = SampleSlots(CAPACITY), StaggeredEngine(), RecordingProducer()

    async def sample_one_group() -> list[int]:
        group = asyncio.create_task(server.groups.sample(engine, SingleTurn(), FixedScorer(), slots.claim(N),
                                                         producer.send, learner_version=0))
        await wait_until_async(lambda: engine.finished, WAIT_S, "the group's first sample")  # the others still generate
        held_meanwhile = slots.in_use
        engine.release.set()
        await group
        return [held_meanwhile, slots.in_use]

    assert asyncio.run(sample_one_group()) == [N - 1, 0]
    assert len(producer.sent) == 1


@dataclass
class BufferAdmission:
    """The buffer's own admission count behind the client's `request`, without sockets."""

    admission: Admission
    accepted: int = 0  # groups stored for training

    def request(self, wanted: int, finished: int = 0, running: int = -1) -> AdmissionGrant:
        granted = self.admission.grant("server-0", wanted, finished, 0, self.accepted, time.monotonic(), running=running)
        return AdmissionGrant(granted, policy_version=0, max_staleness=0)


def test_open_chat_sessions_count_against_the_staleness_bound():
    batch_groups = 2
    buffer = BufferAdmission(Admission(max_staleness=0, batch_groups=batch_groups, timeout_s=60))
    places = ChatAdmission(N)
    asks = AdmissionAsks(SampleSlots(CAPACITY), places, N)

    async def scenario() -> list[tuple[int, int]]:
        rounds = []  # (prompt groups the server may start, grants held for chat) after each request

        async def ask() -> None:
            grant = buffer.request(*asks.ask(asks.wanted(0), 0))
            rounds.append((places.take_grants(grant.granted), places.held))

        sessions = [asyncio.create_task(places.enter(5.0)) for _ in range(N + 1)]
        await wait_until_async(lambda: places.waiting == N + 1, WAIT_S, "every session waiting for a place")
        await ask()  # 3 waiting sessions are 2 groups of N: the whole bound, and before any prompt group
        await asyncio.gather(*sessions)
        await ask()  # the sessions still hold it
        for _ in sessions:
            places.leave()
        await ask()  # closed: the bound is the prompts' again
        return rounds

    assert asyncio.run(scenario()) == [(0, batch_groups), (0, batch_groups), (batch_groups, 0)]


def test_an_ask_reports_the_groups_finished_since_the_last_one_and_the_chat_grants_as_running():
    places = ChatAdmission(N)
    places.held = 1  # one grant held for open chat sessions
    asks = AdmissionAsks(SampleSlots(CAPACITY), places, N)
    asks.group_finished()
    asks.group_finished()

    assert asks.ask(3, 2) == (3, 2, 3)
    assert asks.ask(-1, 0) == (0, 0, 1), "finished counted once; a negative want asks for nothing"
    asks.slots.claim(N)  # one running group
    assert asks.wanted(1) == CAPACITY // N - 1
    assert AdmissionAsks(SampleSlots(1), ChatAdmission(N), N).wanted(0) == 1, "a group larger than the capacity still runs alone"
