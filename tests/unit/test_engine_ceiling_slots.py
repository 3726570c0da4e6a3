"""The engine kept full (scripts/engine_ceiling.py) counts its capacity in samples, as a server does: a group's short
samples free their slots while its longest one still runs, and the next group starts on them. On an engine whose
groups each hold one short and one long sample, replacing whole groups would never run more long samples at once
than there are groups; the server's count runs nearly one per slot. A group that fails ends the measure."""

import asyncio

import pytest

from asyncrl.config.rollout import SamplingConfig
from scripts.engine_ceiling import keep_full

IN_FLIGHT = 8  # slots: 4 groups of 2 at once
GROUP = 2
SHORT_S, LONG_S = 0.01, 0.2  # each group: one sample of each
TOKENS = 5  # every sample's length


class Completion:
    def __init__(self) -> None:
        self.token_ids = [0] * TOKENS


class TailedEngine:
    """Groups of one short and one long sample; counts the samples running and the long ones at most at once."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.groups_started = 0
        self.running = 0
        self.most_running = 0
        self.long_running = 0
        self.most_long_running = 0
        self.tokens_sampled = 0

    @property
    def inflight_requests(self) -> int:
        return self.running

    def inflight_tokens(self) -> dict[str, int]:
        return {}

    async def generate_group(self, prompt_ids, sampling, *, on_sample_done=None):
        self.groups_started += 1
        if self.fail:
            raise RuntimeError("the engine is dead")
        return list(await asyncio.gather(self._sample(SHORT_S, on_sample_done), self._sample(LONG_S, on_sample_done)))

    async def _sample(self, seconds: float, on_sample_done) -> Completion:
        long = seconds == LONG_S
        self.running += 1
        self.long_running += long
        self.most_running = max(self.most_running, self.running)
        self.most_long_running = max(self.most_long_running, self.long_running)
        await asyncio.sleep(seconds)
        self.running -= 1
        self.long_running -= long
        self.tokens_sampled += TOKENS
        if on_sample_done is not None:
            on_sample_done()
        return Completion()


def test_finished_samples_free_their_slots_for_the_next_group_while_their_group_still_runs():
    engine = TailedEngine()
    sampling = SamplingConfig(n=GROUP, max_tokens=TOKENS)
    result = asyncio.run(keep_full(engine, [[1], [2]], sampling, IN_FLIGHT, warmup_s=0.1, seconds=0.6))
    assert engine.most_running <= IN_FLIGHT  # never past the capacity
    # whole groups replaced: at most IN_FLIGHT // GROUP = 4 long samples at once; slots per sample: nearly 8
    assert engine.most_long_running >= IN_FLIGHT - GROUP + 1
    assert result["samples_finished"] > 0 and result["length_mean"] == TOKENS
    assert result["ceiling_tokens_per_s"] == pytest.approx(result["tokens"] / result["window_s"], rel=0.01)


def test_a_failing_group_ends_the_measure_without_starting_groups_on_and_on():
    engine = TailedEngine(fail=True)
    with pytest.raises(RuntimeError, match="groups failed while the engine was kept full"):
        asyncio.run(keep_full(engine, [[1]], SamplingConfig(n=GROUP), IN_FLIGHT, warmup_s=0.05, seconds=0.2))
    assert engine.groups_started <= 2 * IN_FLIGHT // GROUP  # the first fill, and at most one more
