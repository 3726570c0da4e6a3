"""How a rollout server turns one prompt into one acknowledged group (`GroupSampler.sample`), with the
engine, scorer and buffer producer stood in: a group the engine stopped as too stale is sampled once more,
to the end, and sent once under the prompt's record id; each sample frees its slot of the server's
capacity as it finishes, not when its whole group does; open chat sessions count against admission
(`AdmissionAsks`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.data import write_rows
from asyncrl.messages import Ack, AdmissionGrant, Trajectory, TrajectoryGroup
from rollout_servers.rewards import RewardFunctionError, RewardResult
from rollout_servers.rewards.builtin import UnknownDataSourceError
from demo.tiny.tokenizer import build_char_tokenizer
from buffer.admission import Admission
from rollout_servers.admission_asks import AdmissionAsks
from rollout_servers.chat.admission import ChatAdmission
from rollout_servers.completion import STALE, Completion
from rollout_servers.sample_slots import SampleSlots
from rollout_servers.learner_wait import Endpoints
from rollout_servers.server import RolloutServer
from waiting import wait_until_async

N = 2  # samples per group
STOPPED_ATTEMPTS = 1  # attempts the fake engine stops as too stale before it lets one finish
REWARD = 0.75
WAIT_S = 5.0  # for what takes a few event-loop turns, with slack for a loaded box
CAPACITY = 8  # samples a server generates at once (rollout.max_inflight)


@dataclass
class StoppingEngine:
    """Stops the first `stop_first` training groups as too stale (what `abandon_stale` leaves behind);
    records, for every group, whether it was sampled as a stoppable training group."""

    stop_first: int
    slots: SampleSlots
    stoppable: list[bool] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    slots_held: list[int] = field(default_factory=list)  # slots in use when each attempt began
    _training: bool = False

    @contextlib.contextmanager
    def training_group(self):
        self._training = True
        try:
            yield
        finally:
            self._training = False

    async def generate_group(self, prompt_ids, sampling=None, *, seed=None, on_sample_done=None) -> list[Completion]:
        attempt = len(self.stoppable)
        self.stoppable.append(self._training)
        self.seeds.append(seed)
        self.slots_held.append(self.slots.in_use)
        for _ in range(N):
            on_sample_done()
        if attempt < self.stop_first:
            assert self._training, "only a training group may be stopped"
            return [Completion(f"a{attempt}-{i}", list(prompt_ids), [], [], [], STALE) for i in range(N)]
        return [Completion(f"a{attempt}-{i}", list(prompt_ids), [7, 8], [-0.5, -0.25], [attempt, attempt], "stop")
                for i in range(N)]


class SingleTurn:
    def handles(self, data_source: str) -> bool:
        return False


@dataclass
class StoppingAgent:
    """A multi-turn agent loop whose first `stop_first` groups end with an episode stopped as too stale."""

    engine: StoppingEngine

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


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
@pytest.mark.parametrize("stop_first", [0, STOPPED_ATTEMPTS])
def test_a_group_stopped_as_too_stale_is_sampled_once_more_and_sent_once(server, stop_first, multi_turn):
    slots = SampleSlots(CAPACITY)
    engine, producer = StoppingEngine(stop_first, slots), RecordingProducer()
    agent = StoppingAgent(engine) if multi_turn else SingleTurn()

    asyncio.run(server.groups.sample(engine, agent, FixedScorer(), slots.claim(N), producer.send))

    (group,) = producer.sent
    assert group.record_id == group.group_id == "server-0-prompt-0"
    assert [t.completion_ids for t in group.trajectories] == [[7, 8]] * N
    assert [t.token_versions for t in group.trajectories] == [[stop_first] * 2] * N, "the finished attempt's tokens"
    assert all(t.reward == REWARD and t.finish_reason == "stop" for t in group.trajectories)
    # Only the first attempt may be stopped; the one after a stop runs to the end whatever happens.
    assert engine.stoppable == [True] + [False] * stop_first
    assert len(set(engine.seeds)) == 1, "the same prompt, sampled again with its own seeds"
    assert (server.stats.groups_resampled, server.stats.groups_sent) == (stop_first, 1)
    assert engine.slots_held == [N] * (1 + stop_first), "a resampled group holds a slot per sample again"
    assert slots.in_use == 0
    assert server.prompts.owed == 0, "the prompt is acknowledged: a restart does not regenerate it"


@dataclass
class StaggeredEngine:
    """Finishes a group's first sample at once and the others only when `release` is set."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    finished: int = 0  # samples done so far

    @contextlib.contextmanager
    def training_group(self):
        yield

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
        group = asyncio.create_task(server.groups.sample(engine, SingleTurn(), FixedScorer(), slots.claim(N), producer.send))
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
