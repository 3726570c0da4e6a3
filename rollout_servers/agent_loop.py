"""The agent loop of one multi-turn episode, token-in/token-out.

Turn t+1's prompt is turn t's prompt ids + the ids the engine sampled + the observation's ids
(`ChatDelta`): the conversation is never re-tokenized, so the ids the learner trains on are the ids the
engine produced and saw. Each turn is one engine request, so its tokens carry the version spans of the
weights that sampled them; a weight update between turns shows up as a new version on the next turn's
tokens, one inside a turn as two versions within it. Limits end an episode, never the server:

| finish reason  | when                                                              | trained |
| -------------- | ----------------------------------------------------------------- | ------- |
| env_done       | the environment said done                                         | yes     |
| max_turns      | `environment.max_turns` model turns without done                  | yes     |
| max_tokens     | the next turn or observation would pass the episode's token limit | yes     |
| time_budget    | `environment.episode_timeout_s` ran out (a cut turn is dropped)   | yes     |
| abort          | the engine aborted the turn's request                             | yes     |
| env_error      | the environment raised or answered garbage                        | no      |
| env_timeout    | an environment call ran past `environment.call_timeout_s`         | no      |

An episode whose environment failed keeps its tokens but gets loss mask 0 everywhere and reward 0,
with the failure in `reward_error`: a broken environment says nothing about the policy. No episode is
stopped for staleness: its turns run through weight updates, each token with its own version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.config.environment import EnvironmentConfig
from asyncrl.config.rollout import SamplingConfig
from asyncrl.data import PromptRow
from asyncrl.environments import ChatDelta, ModelTurn, Transcript
from rollout_servers.environments.guarded import GuardedEnvironment
from asyncrl.messages import Trajectory
from asyncrl.thinking import Thinking
from rollout_servers.chat.tools import ToolCallReader
from rollout_servers.environments import ENV_ERROR, EnvironmentFailure, EnvironmentRegistry
from rollout_servers.completion import Completion, TokensSoFar
from rollout_servers.row_sampling import SEED_MODULUS, sample_seeds
from rollout_servers.sample_slots import SampleDone, reporting_done

log = logging.getLogger(__name__)

ENV_DONE, MAX_TURNS, MAX_TOKENS, TIME_BUDGET = "env_done", "max_turns", "max_tokens", "time_budget"
ABORT = "abort"  # vLLM's finish reason of an aborted request
TURN_SEED_STRIDE = 7_919  # sampling seed of turn t = the sample's seed + t × this (distinct draws per turn)


class TurnEngine(Protocol):
    """What an episode needs from `RolloutEngine`."""

    @property
    def current_version(self) -> int: ...

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig | None = None, *,
                       seed: int | None = None, request_id: str | None = None,
                       on_tokens: TokensSoFar | None = None, structured_outputs: Any = None) -> Completion: ...


@dataclass
class Episode:
    """A finished episode: its tokens, the environment's reward and why it ended."""

    transcript: Transcript
    reward: float = 0.0  # sum of the environment's step rewards (0 after a failure)
    finish_reason: str = ""  # see the module's table
    num_turns: int = 0  # model turns sampled
    error: str = ""  # the environment's failure, when there was one
    info: dict[str, float] = field(default_factory=dict)  # the last step's info

    def trajectory(self, group_id: str, data_source: str) -> Trajectory:
        return self.transcript.trajectory(self.reward, group_id, data_source, self.finish_reason, self.num_turns,
                                          self.info, self.error)


class AgentLoop:
    """Runs episodes of the registry's environments on one engine."""

    def __init__(self, engine: TurnEngine, tokenizer: Any, registry: EnvironmentRegistry,
                 limits: EnvironmentConfig, max_model_len: int, thinking: Thinking = Thinking()) -> None:
        """`thinking`: how the chat template is rendered and model turns' thinking blocks trained (rollout.thinking)."""
        self._engine = engine
        self._tokenizer = tokenizer
        self._registry = registry
        self._limits = limits
        self._max_tokens = limits.total_token_limit(max_model_len)
        self._thinking = thinking
        self._chat = ChatDelta(tokenizer, thinking)
        # read now: a parser vLLM does not know stops the server at start, naming the key
        self._tool_calls = (ToolCallReader(limits.tool_parser, tokenizer, "environment.tool_parser")
                            if limits.tool_parser else None)

    def handles(self, data_source: str) -> bool:
        return self._registry.handles(data_source)

    async def run_group(self, row: PromptRow, sampling: SamplingConfig, seed: int | None, group_id: str,
                        on_sample_done: SampleDone | None = None) -> list[Trajectory]:
        """`sampling.n` episodes of `row`, each with its own environment and seed; `on_sample_done` is told
        as each episode finishes."""
        episodes = await asyncio.gather(*(reporting_done(self.run(row, sampling, s), on_sample_done)
                                          for s in sample_seeds(seed, sampling.n)))
        return [episode.trajectory(group_id, row.data_source) for episode in episodes]

    async def run(self, row: PromptRow, sampling: SamplingConfig, seed: int | None = None) -> Episode:
        """One episode of `row`; whatever its environment does, it returns a finished episode."""
        deadline = time.monotonic() + self._limits.episode_timeout_s
        episode = Episode(Transcript(prompt_ids=[], start_version=self._engine.current_version))
        environment: GuardedEnvironment | None = None
        try:
            environment = self._registry.create(row.data_source)
            messages = await environment.reset(row, self._call_timeout(deadline))
            tools = self._tools_of(environment)
            episode.transcript.prompt_ids = self._chat.prompt_ids(messages, tools)
            episode.finish_reason = await self._play(environment, episode, sampling, seed, deadline, tools)
        except EnvironmentFailure as failure:
            self._fail(episode, row, failure)
        if environment is not None:
            try:
                await environment.close(self._limits.call_timeout_s)
            except EnvironmentFailure as failure:
                self._fail(episode, row, failure)
        return episode

    def _tools_of(self, environment: GuardedEnvironment) -> list[dict[str, Any]] | None:
        tools = environment.tools()
        if tools and self._tool_calls is None:
            raise EnvironmentFailure(ENV_ERROR, f"environment '{environment.name}' has tools but no parser reads "
                                                "the model's calls: set environment.tool_parser (e.g. hermes)")
        return tools

    async def _play(self, environment: GuardedEnvironment, episode: Episode, sampling: SamplingConfig,
                    seed: int | None, deadline: float, tools: list[dict[str, Any]] | None) -> str:
        """Alternate model turns and environment steps until a limit or the environment ends it."""
        transcript = episode.transcript
        for turn in range(self._limits.max_turns):
            room = self._max_tokens - transcript.total_tokens()
            if room <= 0:
                return MAX_TOKENS
            completion = await self._sample(transcript, sampling, room, _turn_seed(seed, turn), deadline)
            if completion is None:
                return TIME_BUDGET
            transcript.add_model_turn(completion.token_ids, completion.logprobs, completion.versions, self._thinking)
            episode.num_turns += 1
            if completion.finish_reason == ABORT:
                return ABORT
            text = self._tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            calls = self._tool_calls.read_turn(completion.token_ids, tools) if tools else []
            model_turn = ModelTurn(text, list(completion.token_ids), completion.finish_reason, turn, calls)
            result = await environment.step(model_turn, self._call_timeout(deadline))
            episode.reward += result.reward
            episode.info = dict(result.info)
            if result.done:
                return ENV_DONE
            observation = self._chat.observation_ids(result.observation, completion.token_ids, tools)
            if transcript.total_tokens() + len(observation) >= self._max_tokens:
                return MAX_TOKENS  # no room left for a model turn after it: the observation would teach nothing
            transcript.add_observation(observation)
        return MAX_TURNS

    async def _sample(self, transcript: Transcript, sampling: SamplingConfig, room: int, seed: int | None,
                      deadline: float) -> Completion | None:
        """One model turn capped by the token room left, or None when the episode's time runs out first."""
        turn_sampling = dataclasses.replace(sampling, n=1, max_tokens=min(sampling.max_tokens, room))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            request = self._engine.generate(transcript.context(), turn_sampling, seed=seed)
            return await asyncio.wait_for(request, remaining)
        except asyncio.TimeoutError:
            return None

    def _call_timeout(self, deadline: float) -> float:
        """An environment call's deadline: its own limit, or what is left of the episode's budget if less."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EnvironmentFailure(TIME_BUDGET, "the episode's time budget ran out before an environment call")
        return min(self._limits.call_timeout_s, remaining)

    def _fail(self, episode: Episode, row: PromptRow, failure: EnvironmentFailure) -> None:
        if failure.finish_reason == TIME_BUDGET:  # the budget, not the environment, ended it: a normal episode
            episode.finish_reason = TIME_BUDGET
            return
        log.warning("episode of %s (%s row %d) ended by its environment: %s", row.data_source, row.source_file,
                    row.row_index, failure)
        if not episode.transcript.prompt_ids:  # reset failed: keep the row's own prompt so the sample is well-formed
            episode.transcript.prompt_ids = self._chat.prompt_ids(row.messages)
        episode.transcript.untrained()
        episode.reward, episode.finish_reason, episode.error = 0.0, failure.finish_reason, str(failure)


def _turn_seed(seed: int | None, turn: int) -> int | None:
    return None if seed is None else (seed + turn * TURN_SEED_STRIDE) % SEED_MODULUS
