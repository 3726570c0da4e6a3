"""One prompt's group, from the server's prompt stream to the buffer: take the next prompt that fits,
sample its group to the end (single-turn through the engine and the scorer, multi-turn through the agent
loop; however long it runs, nothing stops it for staleness), send it and acknowledge it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator

from asyncrl.config import AsyncRLConfig
from asyncrl.data import PromptRow, encode_prompt
from asyncrl.messages import Ack, Trajectory, TrajectoryGroup
from asyncrl.thinking import Thinking
from rollout_servers.rewards import RewardRequest, RewardScorer
from rollout_servers.agent_loop import AgentLoop
from rollout_servers.engine import RolloutEngine
from rollout_servers.prompt_stream import PromptStream
from rollout_servers.row_sampling import group_seed, sampling_for_row
from rollout_servers.sample_slots import Claim
from rollout_servers.work_tally import start_tally

log = logging.getLogger(__name__)

SendGroup = Callable[[TrajectoryGroup], Awaitable[Ack]]  # to the buffer, acknowledged


@dataclass
class ServerStats:
    groups_sent: int = 0
    prompts_skipped: int = 0
    groups_duplicate: int = 0  # regenerated groups the buffer already held (acknowledged just before a crash)
    tokens_cut: int = 0  # completion tokens of groups cut short when the server stopped: sampled, never sent
    idle_seconds: float = 0.0


@dataclass(frozen=True)
class GroupJob:
    """One prompt's group while it is sampled."""

    row: PromptRow
    prompt_ids: list[int]
    number: int  # place in the server's prompt stream: seeds, acknowledgement
    group_id: str  # the same for a regeneration, so the buffer keeps one
    slots: Claim  # a slot of the server's capacity per sample not yet finished
    learner_version: int  # the learner's version (the server's last admission answer) when the group started


class GroupSampler:
    def __init__(self, config: AsyncRLConfig, server_id: str, seed_base: int, prompts: PromptStream, tokenizer,
                 stats: ServerStats, thinking: Thinking) -> None:
        self.config = config
        self.server_id = server_id
        self.seed_base = seed_base  # the server's own seed stream (run.seed and its index)
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.stats = stats  # counted in place: the server reports them
        self.thinking = thinking  # how prompts are rendered and thinking blocks trained (rollout.thinking)

    async def sample(self, engine: RolloutEngine, agent: AgentLoop, scorer: RewardScorer, slots: Claim,
                     send: SendGroup, learner_version: int) -> None:
        """Sample the next prompt's group, started now while the learner is at `learner_version`, send it and
        acknowledge the prompt; `slots` is released on the way."""
        tally = start_tally()
        try:
            number, (row, prompt_ids) = self.prompts.take(self._fitting_prompt)
            job = GroupJob(row, prompt_ids, number, f"{self.server_id}-prompt-{number}", slots, learner_version)
            trajectories = await self._sample_group(engine, agent, scorer, job)
        except asyncio.CancelledError:  # the server stops: its next process samples the prompt again
            self.stats.tokens_cut += tally.tokens
            raise
        finally:
            slots.release()
        group = TrajectoryGroup(record_id=job.group_id, group_id=job.group_id, server_id=self.server_id,
                                trajectories=trajectories)
        group.learner_version_at_start = learner_version_at_start(job.learner_version, group)
        ack = await send(group)
        self.prompts.acknowledge(number)
        self.stats.groups_duplicate += ack.duplicate
        self.stats.groups_sent += 1

    async def _sample_group(self, engine: RolloutEngine, agent: AgentLoop, scorer: RewardScorer,
                            job: GroupJob) -> list[Trajectory]:
        """The prompt's scored trajectories."""
        row, seed, done = job.row, self._group_seed(job.number), job.slots.sample_done
        sampling = sampling_for_row(row, self.config.rollout.sampling)
        if agent.handles(row.data_source):  # multi-turn: the environment plays the episode and gives the reward
            return await agent.run_group(row, sampling, seed, job.group_id, on_sample_done=done)
        completions = await engine.generate_group(job.prompt_ids, sampling, seed=seed, on_sample_done=done)
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        results = await scorer.score_async([RewardRequest(row.data_source, text, row.ground_truth, row.extra_info) for text in texts])
        return [c.trajectory(r.score, r.info, r.error, job.group_id, row.data_source, self.thinking)
                for c, r in zip(completions, results)]

    def _group_seed(self, number: int) -> int | None:
        rollout = self.config.rollout
        return group_seed(self.seed_base, number, rollout.sampling.n, rollout.seeded_sampling)

    def _fitting_prompt(self, rows: Iterator[PromptRow]) -> tuple[PromptRow, list[int]]:
        """The next row whose prompt fits `data.max_prompt_length` (longer ones are skipped and counted)."""
        while True:
            row = next(rows)
            prompt_ids = encode_prompt(self.tokenizer, row, self.thinking)
            if len(prompt_ids) <= self.config.data.max_prompt_length:
                return row, prompt_ids
            self.stats.prompts_skipped += 1
            log.warning("skipping %s row %d: prompt of %d tokens > data.max_prompt_length", row.source_file,
                        row.row_index, len(prompt_ids))


def learner_version_at_start(admitted_under: int, group: TrajectoryGroup) -> int:
    """The learner version a group started under: that of the admission answer it was started with, or the version of
    its first token where that is newer. The learner sends weights before the buffer hears their version, and a server
    reads the buffer only once a poll, so its engine may sample a group's first token with weights newer than its last
    answer named; the learner had reached them, and a start stamped with the older answer read as a negative lag."""
    return max(admitted_under, group.start_version())
