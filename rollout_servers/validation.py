"""Periodic validation on the held-out prompts, run by rollout server 0 beside its generation.

Whenever the engine's weights reach a policy version that is a multiple of `validation.every`, the
server samples `validation.n` completions of each held-out prompt on the same engine, scores them with
the same reward scorer as training, and keeps the `val/*` metrics (`asyncrl.validation_scores`). The server's
telemetry carries its latest few passes to the learner, which logs each once. A pass runs concurrently with training
generation; a weight update during the pass leaves its later tokens on newer weights, so the numbers
are for the version the pass started on or a newer one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from asyncrl.config import AsyncRLConfig
from asyncrl.config.rollout import SamplingConfig
from asyncrl.config.validation import ValidationConfig
from asyncrl.data import PromptRow, encode_prompt, load_prompt_file
from asyncrl.staleness import starts_within_bound
from asyncrl.thinking import Thinking
from rollout_servers.rewards import RewardRequest, RewardResult
from asyncrl.validation_scores import NOT_VALIDATED, PromptOutcome, validation_metrics
from asyncrl.weight_transfer.control_messages import ValidationResult
from rollout_servers.row_sampling import SEED_MODULUS, group_seed

if TYPE_CHECKING:  # the module itself stays free of vLLM, so that it is testable with a fake engine
    from asyncrl.messages import Trajectory
    from rollout_servers.completion import Completion

log = logging.getLogger(__name__)

VALIDATION_GROUP_ID = "validation"  # validation episodes are measured, never sent to the buffer
# Validation's seeds start here past run.seed, away from the training streams (run.seed + 1,000,003 × server).
VALIDATION_SEED_OFFSET = 1_000_000_007
# Passes each report repeats: a learner that read no report between two passes (a short pass, a busy learner)
# still hears the earlier one.
RECENT_PASSES = 8

class GroupEngine(Protocol):
    """What a pass needs from `RolloutEngine`."""

    @property
    def current_version(self) -> int: ...

    @property
    def needs_catch_up(self) -> bool: ...

    async def generate_group(self, prompt_ids: list[int], sampling: SamplingConfig | None = None, *,
                             seed: int | None = None) -> list[Completion]: ...


class Episodes(Protocol):
    """What a pass needs from `AgentLoop` (prompts of multi-turn data sources are played out as episodes)."""

    def handles(self, data_source: str) -> bool: ...

    async def run_group(self, row: PromptRow, sampling: SamplingConfig, seed: int | None,
                        group_id: str) -> list[Trajectory]: ...


class Scorer(Protocol):
    """What a pass needs from `RewardScorer`."""

    async def score_async(self, requests: Sequence[RewardRequest]) -> list[RewardResult]: ...


@dataclass(frozen=True)
class ValidationPrompt:
    row: PromptRow
    prompt_ids: list[int]


def load_validation_prompts(config: AsyncRLConfig, tokenizer: Any) -> list[ValidationPrompt]:
    """The first `validation.max_prompts` rows of `data.val_files` (all when 0) that fit
    `data.max_prompt_length`, tokenized as training prompts are."""
    limit, thinking = config.validation.max_prompts, Thinking.for_tokenizer(config.rollout.thinking, tokenizer)
    prompts = []
    for path in config.data.val_files:
        for row in load_prompt_file(path, config.data.skip_bad_rows):
            prompt_ids = encode_prompt(tokenizer, row, thinking)
            if len(prompt_ids) <= config.data.max_prompt_length:
                prompts.append(ValidationPrompt(row, prompt_ids))
            if limit and len(prompts) == limit:
                return prompts
    return prompts


class Validator:
    """Runs passes when due and holds the latest few results, which the server reports to the learner (`results`)."""

    def __init__(self, settings: ValidationConfig, sampling: SamplingConfig, prompts: list[ValidationPrompt],
                 tokenizer: Any, run_seed: int = 0) -> None:
        """With `settings.seeded`, held-out prompt i's samples draw seeds from (`run_seed`, i) in every pass: a
        policy scores the same each time, and two versions are compared on the same draws, so the gap between
        their scores is the policy's (the sampler's noise, 0.02-0.05 on 64 prompts, cancels)."""
        self.settings = settings
        self.seed_base = (run_seed + VALIDATION_SEED_OFFSET) % SEED_MODULUS
        self.requested: set[int] = set()  # versions the learner asked for (its final one), whatever `every` is
        self.sampling = dataclasses.replace(sampling, n=settings.n, temperature=settings.temperature)
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.metrics: dict[str, float] = {}  # val/* of the latest pass
        self.version = NOT_VALIDATED  # policy version the latest pass started on
        self.recent: deque[tuple[int, dict[str, float]]] = deque(maxlen=RECENT_PASSES)  # (version, val/*), oldest first
        self.learner: tuple[int, int] | None = None  # (learner version, K) of the latest admission answer

    def follow(self, learner_version: int, max_staleness: int) -> None:
        """The learner's version and K, as the server's latest admission answer gives them (`run_when_due`)."""
        self.learner = (learner_version, max_staleness)

    def near_learner(self, version: int) -> bool:
        """Whether a pass of `version` measures the job now: the learner answered, and `version` is within its K. A
        server that (re)starts on the model's first weights while the learner is further on (a resumed job, a
        restarted server) catches up before it validates anything, instead of scoring version 0 again."""
        if self.learner is None:
            return False
        learner_version, max_staleness = self.learner
        return starts_within_bound(learner_version, version, max_staleness)

    def request(self, version: int) -> None:
        """Validate `version` once the engine holds it, multiple of `every` or not (the learner's final version)."""
        self.requested.add(version)

    def is_due(self, version: int) -> bool:
        """A multiple of `every`, or a requested version, not validated yet (validation off when `every` is 0)."""
        if not self.settings.every or not self.prompts or version <= self.version:
            return False
        return version % self.settings.every == 0 or version in self.requested

    async def run_pass(self, engine: GroupEngine, scorer: Scorer, episodes: Episodes | None = None) -> dict[str, float]:
        """Sample, score and summarise every validation prompt on the engine's current weights."""
        started, version = time.perf_counter(), engine.current_version
        outcomes = await self.outcomes(engine, scorer, episodes, range(len(self.prompts)))
        return self.record(outcomes, version, time.perf_counter() - started)

    async def outcomes(self, engine: GroupEngine, scorer: Scorer, episodes: Episodes | None,
                       places: Sequence[int]) -> list[PromptOutcome]:
        """The held-out prompts at `places` (their indices), sampled and scored on the engine's current weights,
        each on its own seeds: a pass split among engines scores as one pass on one engine."""
        return list(await asyncio.gather(*(self._outcome(engine, scorer, episodes, self.prompts[place], self._seed(place))
                                           for place in places)))

    def record(self, outcomes: Sequence[PromptOutcome], version: int, seconds: float) -> dict[str, float]:
        """The pass of `version` over every held-out prompt (`outcomes`, in `seconds`) as the latest: its metrics."""
        self.metrics = validation_metrics(outcomes, self.settings.k, self.settings.length_buckets) | {"val/seconds": seconds}
        self.version = version
        self.recent.append((version, self.metrics))
        log.info("validation of version %d: mean score %.3f, pass@%d %.3f over %d prompts in %.1fs", version,
                 self.metrics["val/score/mean"], self.settings.k, self.metrics[f"val/pass@{self.settings.k}"],
                 len(outcomes), seconds)
        return self.metrics

    def results(self, server_id: str) -> list[ValidationResult]:
        """The latest passes (up to RECENT_PASSES, oldest first) as server `server_id` reports them; [] before the
        first."""
        return [ValidationResult(server_id, version, dict(metrics)) for version, metrics in self.recent]

    async def run_when_due(self, engine: GroupEngine, scorer: Scorer, poll_s: float,
                           episodes: Episodes | None = None) -> None:
        """Watch the engine's version and validate each due one near the learner's (`follow`), until cancelled."""
        while True:
            version = engine.current_version
            if self.is_due(version) and not engine.needs_catch_up and self.near_learner(version):
                try:
                    await self.run_pass(engine, scorer, episodes)
                except Exception:  # validation is a measurement: it must never stop the server's generation
                    log.exception("validation of version %d failed; next try at the next multiple", version)
                    self.version = version
            await asyncio.sleep(poll_s)

    def _seed(self, index: int) -> int | None:
        """The seed of held-out prompt `index`'s group (its samples: this + their index), None when unseeded."""
        return group_seed(self.seed_base, index, self.sampling.n, self.settings.seeded)

    async def _outcome(self, engine: GroupEngine, scorer: Scorer, episodes: Episodes | None,
                       prompt: ValidationPrompt, seed: int | None) -> PromptOutcome:
        row = prompt.row
        if episodes is not None and episodes.handles(row.data_source):
            trajectories = await episodes.run_group(row, self.sampling, seed, VALIDATION_GROUP_ID)
            return PromptOutcome(row.data_source, [t.reward for t in trajectories], [t.reward_info for t in trajectories],
                                 [sum(t.loss_mask) for t in trajectories])
        completions = await engine.generate_group(prompt.prompt_ids, self.sampling, seed=seed)
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        results = await scorer.score_async([RewardRequest(row.data_source, t, row.ground_truth, row.extra_info) for t in texts])
        return PromptOutcome(row.data_source, [result.score for result in results], [result.info for result in results],
                             [len(c.token_ids) for c in completions])
