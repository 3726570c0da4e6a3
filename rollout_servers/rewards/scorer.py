"""The reward API for rollout servers: score completions in worker processes, blocking or from asyncio."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Iterable, Sequence

from rollout_servers.rewards.builtin import check_data_sources
from rollout_servers.rewards.pool import ScoringPool
from rollout_servers.rewards.results import RewardRequest, RewardResult
from rollout_servers.rewards.terms import RewardSpec, load_reward

if TYPE_CHECKING:
    from asyncrl.config.sections import RewardConfig


class RewardScorer:
    """Scores completions with the configured reward: `reward.custom_fn` if set, else built-ins by data_source;
    tasks with `reward.terms` get the weighted sum of their terms.

    Starting it loads the custom function (and the terms' functions) here first, so that a missing file, function or wrong signature
    fails at startup with a `RewardFunctionError`, then starts `reward.num_workers` processes (a few seconds).
    A sample whose scorer raises or runs past `reward.timeout_s` gets a failed `RewardResult` (score 0.0,
    error set); scoring never raises for one bad sample. Use as a context manager, or call `close()`.
    """

    def __init__(self, config: RewardConfig, wait_ready: bool = True) -> None:
        """`wait_ready=False` returns once the workers are spawned: they import while the caller starts its engine,
        and scoring begins at `wait_ready()`."""
        check_reward_setup(config, data_sources=())  # a custom function that does not load fails here, not in a worker
        self._pool = ScoringPool(RewardSpec.from_config(config), config.num_workers, config.timeout_s, wait_ready)

    def wait_ready(self) -> None:
        """Block until the workers have loaded the reward function (WorkerStartError with their error)."""
        self._pool.wait_ready()

    def submit(self, request: RewardRequest) -> Future[RewardResult]:
        """Queue one request without waiting; the future always completes, with a result or a failure."""
        return self._pool.submit(request)

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """Score a batch in parallel and wait; results are in request order."""
        futures = [self.submit(request) for request in requests]
        return [future.result() for future in futures]

    async def score_async(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """Score a batch without blocking the event loop; results are in request order."""
        futures = [asyncio.wrap_future(self.submit(request)) for request in requests]
        return list(await asyncio.gather(*futures))

    def close(self) -> None:
        """Stop the workers; requests still queued or running get a failed result. Idempotent."""
        self._pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def check_reward_setup(config: RewardConfig, data_sources: Iterable[str]) -> None:
    """What scoring `data_sources` would fail on, checked without starting workers: a custom function or a
    term's function that does not load (`RewardFunctionError`), or, with the built-ins, a data source that
    none of them handles and no term covers (`UnknownDataSourceError`)."""
    spec = RewardSpec.from_config(config)
    load_reward(spec)
    if not spec.path:
        check_data_sources(spec.sources_scored_by_default(data_sources))
