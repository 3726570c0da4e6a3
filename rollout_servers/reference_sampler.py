"""The generation half of the synchronous reference (`learner.mode=synchronous`, `launch.reference_loop`): one vLLM
engine in this process samples a batch of prompt groups with the weights it holds, the groups are scored,
and each new policy is loaded through the engine's weight-update path.

The prompts and sampling seeds are those of rollout server 0 of an async job with the same `run.seed`:
prompt `k` of the mixture seeded with `run.seed`, its group seeded `group_seed(run.seed, k, n)`. So the
async job with one server and `buffer.max_staleness=0` can be compared with this, sample for sample.

With `learner.nproc` = N ranks colocated, each rank's sampler draws the same stream and samples only its share of
each step's prompts (`rank_share`: consecutive runs, rank 0's first), so the ranks' groups in rank order are the
batch one rank would sample: the same prompts, group ids and seeds.

It validates as rollout server 0 does (`rollout_servers.validation`: the same held-out prompts, seeds and
`val/*` metrics) whenever the engine's weights reach a version due, between the steps; with N ranks each scores its
share of the held-out prompts on its own engine (`rank_share` again), and the shares are pooled into one pass."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Iterator, Sequence

import torch
from transformers import AutoTokenizer

from asyncrl.config import AsyncRLConfig
from asyncrl.data import PromptMixture, PromptRow, encode_prompt
from rollout_servers.environments import EnvironmentRegistry
from asyncrl.messages import Trajectory, TrajectoryGroup
from asyncrl.net import LOOPBACK
from asyncrl.gpu_ids import VISIBLE_DEVICES
from asyncrl.thinking import Thinking
from asyncrl.validation_scores import VERSION_KEY, decode_outcomes, encode_outcomes
from rollout_servers.rewards import RewardRequest, RewardScorer
from asyncrl.weight_transfer import SendingEnd, WeightBackend, update_info_for
from rollout_servers.agent_loop import AgentLoop
from rollout_servers.cancelled import cancel_and_wait
from rollout_servers.completion import Completion
from rollout_servers.engine import RolloutEngine
from rollout_servers.row_sampling import group_seed, sampling_for_row
from rollout_servers.validation import Validator, load_validation_prompts

log = logging.getLogger(__name__)

GROUP_ID_PREFIX = "sync-prompt-"  # group ids: the prefix and the prompt's number in the stream


@dataclasses.dataclass(frozen=True)
class Prompt:
    row: PromptRow
    ids: list[int]  # the row's chat as token ids
    number: int  # place in the prompt stream: the group's seed and id


def rank_share(count: int, rank: int, ranks: int) -> range:
    """The places, among a step's `count` prompts, that rank `rank` of `ranks` samples: consecutive, rank 0's first,
    together each place once; the first `count % ranks` ranks take one more than the others."""
    size, larger = divmod(count, ranks)
    start = rank * size + min(rank, larger)
    return range(start, start + size + (rank < larger))


class ReferenceSampler:
    def __init__(self, config: AsyncRLConfig, loop: asyncio.AbstractEventLoop, engine: RolloutEngine,
                 backend: WeightBackend, sender: SendingEnd, scorer: RewardScorer, rank: int = 0,
                 ranks: int = 1) -> None:
        self.config = config
        self._share = rank_share(config.buffer.batch_groups, rank, ranks)  # of each step's prompts
        self._loop = loop  # every engine call runs on it: vLLM's AsyncLLM stays bound to the loop that first used it
        self._engine = engine
        self._backend = backend  # how the weights reach the engine
        self._sender = sender  # this process's end of it
        self._joined = False  # the engine knows where the weights come from (ipc: where the current buffer is)
        self._scorer = scorer
        self._tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self._thinking = Thinking.for_tokenizer(config.rollout.thinking, self._tokenizer)
        self._agent = AgentLoop(engine, self._tokenizer, EnvironmentRegistry.from_config(config.environment.by_source),
                                config.environment, config.rollout.engine.max_model_len, self._thinking)
        self._mixture = PromptMixture(config.data.train_files, config.data.weights, seed=config.run.seed,
                                      shuffle=config.data.shuffle, skip_bad_rows=config.data.skip_bad_rows)
        self._drawn = 0  # prompts taken from the stream so far
        held_out = load_validation_prompts(config, self._tokenizer) if config.validation.during_run else []
        self._validator = Validator(config.validation, config.rollout.sampling, held_out, self._tokenizer, config.run.seed)
        self._held_out_share = rank_share(len(held_out), rank, ranks)  # of each validation pass's prompts
        self._validator.request(config.learner.total_steps)  # the final version, as the async learner asks for it

    @classmethod
    def start(cls, config: AsyncRLConfig, gpus: Sequence[int] | None, backend: WeightBackend, rank: int = 0,
              ranks: int = 1) -> ReferenceSampler:
        """Start the engine on `model.path` (policy version 0), on `gpus` (physical ids; None: those this process
        sees); the weights reach it over `backend` (`group_backend`: CUDA IPC on a GPU it shares with this process,
        NCCL to GPUs of its own, gloo without a GPU), joined at the first load. `rank` of `ranks`: the share of each
        step's prompts it samples (`rank_share`)."""
        loop = asyncio.new_event_loop()
        scorer = RewardScorer(config.reward, wait_ready=False)  # its workers import while the engine starts
        engine: RolloutEngine | None = None
        try:
            with _visible_to_children(gpus):
                engine = loop.run_until_complete(RolloutEngine.start(config.model.path, config.rollout, version=0,
                                                                     lora=config.model.lora,
                                                                     gpu_memory_gib=config.run.gpu_memory_gib))
            scorer.wait_ready()
            return cls(config, loop, engine, backend, backend.sending_end(), scorer, rank, ranks)
        except BaseException:  # nothing is the caller's to close yet
            scorer.close()
            if engine is not None:
                engine.shutdown()
            raise

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (held-out prompts are encoded with it)."""
        return self._tokenizer

    @property
    def weights_device(self) -> torch.device:
        """Where `load_weights` takes the weights from without a copy: this process's GPU for NCCL, else the CPU."""
        return self._backend.device()

    def sample(self) -> list[TrajectoryGroup]:
        """This sampler's share of the next `buffer.batch_groups` prompts (all of them with one rank), each sampled
        `rollout.sampling.n` times and scored. Every rank draws them all: the stream stays the same on each."""
        drawn = [self._next_prompt() for _ in range(self.config.buffer.batch_groups)]
        prompts = [drawn[place] for place in self._share]

        async def batch() -> list[TrajectoryGroup]:
            return list(await asyncio.gather(*(self._group(prompt) for prompt in prompts)))

        return self._loop.run_until_complete(batch())

    def load_weights(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> float:
        """Load `weights` into the engine as policy `version`; returns the seconds the engine was paused."""
        async def transfer() -> float:
            staged = self._sender.stage(weights)  # ipc: the copy into the buffer the engine maps
            if staged.moved or not self._joined:
                await self._join()
            _, paused_s = await asyncio.gather(asyncio.to_thread(self._sender.send, staged),
                                               self._engine.update_weights(update_info_for(weights), version))
            return paused_s

        return self._loop.run_until_complete(transfer())

    def validate(self, gathered: Callable[[bytes], list[bytes]]) -> dict[str, float]:
        """A validation pass on the engine's weights when their version is due (a multiple of `validation.every`,
        or the final one): its `val/*` metrics and `val/version`; {} when none is due. Every rank calls it (the
        versions move in step): each scores its share of the held-out prompts, and `gathered` (every rank's bytes,
        in rank order) pools the shares, so that every rank returns the whole pass's metrics."""
        version = self._engine.current_version
        if not self._validator.is_due(version):
            return {}
        started = time.perf_counter()
        log.info("validating version %d: %d of the %d held-out prompts on this engine", version,
                 len(self._held_out_share), len(self._validator.prompts))
        mine = self._loop.run_until_complete(
            self._validator.outcomes(self._engine, self._scorer, self._agent, self._held_out_share))
        pooled = [outcome for share in gathered(encode_outcomes(mine)) for outcome in decode_outcomes(share)]
        return self._validator.record(pooled, version, time.perf_counter() - started) | {VERSION_KEY: float(version)}

    def score(self, validator: Validator) -> dict[str, float]:
        """A pass of `validator` (its held-out prompts and seeds) on the engine's weights: its `val/*` metrics."""
        return self._loop.run_until_complete(validator.run_pass(self._engine, self._scorer, self._agent))

    async def _join(self) -> None:
        """Tell the engine's workers where the weights come from: a loopback group with this process as rank 0 (ipc:
        the buffer they map), as a rollout server is told, through vLLM's weight-transfer API, with no coordinator."""
        workers = self.config.rollout.engine.tensor_parallel_size
        address = self._sender.address(LOOPBACK, 0, 1 + workers, self.config.rollout.weight_sync.timeout_s)
        await asyncio.gather(asyncio.to_thread(self._sender.connect, address),
                             self._engine.join_weight_sync(self._sender.init_info(address, rank_offset=1)))
        self._joined = True

    def close(self) -> None:
        self._scorer.close()
        self._sender.close()
        self._engine.shutdown()
        # vLLM's output handler waits on its engine's outputs forever: left pending on a loop that is then collected,
        # it is destroyed mid-wait and logs an error from the closed loop
        self._loop.run_until_complete(cancel_and_wait(asyncio.all_tasks(self._loop)))
        self._loop.close()

    def _next_prompt(self) -> Prompt:
        """The stream's next prompt that fits `data.max_prompt_length` (a longer one is skipped, as a server does)."""
        number = self._drawn
        self._drawn += 1
        while True:
            row = next(self._mixture)
            ids = encode_prompt(self._tokenizer, row, self._thinking)
            if len(ids) <= self.config.data.max_prompt_length:
                return Prompt(row, ids, number)
            log.warning("skipping %s row %d: prompt of %d tokens > data.max_prompt_length", row.source_file,
                        row.row_index, len(ids))

    async def _group(self, prompt: Prompt) -> TrajectoryGroup:
        """The prompt's `n` samples with their rewards (a multi-turn source plays its episodes instead)."""
        rollout, row = self.config.rollout, prompt.row
        sampling = sampling_for_row(row, rollout.sampling)
        seed = group_seed(self.config.run.seed, prompt.number, sampling.n, rollout.seeded_sampling)
        group_id = f"{GROUP_ID_PREFIX}{prompt.number}"
        if self._agent.handles(row.data_source):
            trajectories = await self._agent.run_group(row, sampling, seed, group_id)
        else:
            completions = await self._engine.generate_group(prompt.ids, sampling, seed=seed)
            trajectories = await self._scored(completions, row, group_id)
        return TrajectoryGroup(record_id=group_id, group_id=group_id, server_id="reference", trajectories=trajectories)

    async def _scored(self, completions: list[Completion], row: PromptRow, group_id: str) -> list[Trajectory]:
        texts = [self._tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        requests = [RewardRequest(row.data_source, text, row.ground_truth, row.extra_info) for text in texts]
        results = await self._scorer.score_async(requests)
        return [c.trajectory(r.score, r.info, r.error, group_id, row.data_source, self._thinking)
                for c, r in zip(completions, results)]


@contextlib.contextmanager
def _visible_to_children(gpus: Sequence[int] | None) -> Iterator[None]:
    """Processes started inside (vLLM's engine core and workers) see only `gpus`. This one must not open CUDA inside
    where that narrows its view: CUDA reads the variable once, so it would see only `gpus` for good, and a rank's
    device index would name another GPU or none. That ends in an error naming it, at the engine's start."""
    if gpus is None:
        yield
        return
    previous = os.environ.get(VISIBLE_DEVICES)
    narrowed = ",".join(str(gpu) for gpu in gpus)
    opened_before = torch.cuda.is_initialized()
    os.environ[VISIBLE_DEVICES] = narrowed
    try:
        yield
    finally:
        if previous is None:
            del os.environ[VISIBLE_DEVICES]
        else:
            os.environ[VISIBLE_DEVICES] = previous
    if narrowed != previous and not opened_before and torch.cuda.is_initialized():
        raise RuntimeError(f"this process opened CUDA while its engine started with {VISIBLE_DEVICES}={narrowed}, "
                           f"so it now sees those GPUs alone, not {previous or 'every GPU'}: the engine's start must "
                           "not open CUDA in the starting process")
