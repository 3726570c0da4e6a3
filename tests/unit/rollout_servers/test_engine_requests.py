"""What RolloutEngine asks vLLM for and counts, with AsyncLLM stood in: prefix-cache salts, sampled tokens."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from asyncrl.config.rollout import RolloutConfig
from rollout_servers.engine import RolloutEngine


class RecordingLLM:
    """Stands in for AsyncLLM: records each prompt and returns a one-token final output."""

    model_config = SimpleNamespace(quantization=None)

    def __init__(self) -> None:
        self.prompts: list[dict] = []

    async def generate(self, prompt: dict, params, request_id: str):
        self.prompts.append(prompt)
        token = SimpleNamespace(logprob=-0.5)
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=[{5: token}], finish_reason="stop")])


def test_prefix_cache_salt_follows_the_policy_version() -> None:
    llm = RecordingLLM()
    engine = RolloutEngine(llm, RolloutConfig(), version=3)

    async def sample_twice() -> None:
        await engine.generate([1, 2, 3])
        await engine.generate([1, 2, 3])

    asyncio.run(sample_twice())
    engine._version = 4  # what a completed update leaves behind
    asyncio.run(engine.generate([1, 2, 3]))

    salts = [prompt["cache_salt"] for prompt in llm.prompts]
    assert salts[0] == salts[1], "requests under one version share prompt blocks"
    assert salts[2] != salts[0], "a request under new weights must not reuse old key/values"
    assert all(prompt["prompt_token_ids"] == [1, 2, 3] for prompt in llm.prompts)


def test_every_finished_request_counts_its_sampled_tokens() -> None:
    engine = RolloutEngine(RecordingLLM(), RolloutConfig(), version=0)

    async def sample() -> None:
        await engine.generate([1, 2, 3])
        await engine.generate_group([4], RolloutConfig().sampling)

    asyncio.run(sample())
    assert engine.tokens_sampled == 1 + RolloutConfig().sampling.n  # one token per request
