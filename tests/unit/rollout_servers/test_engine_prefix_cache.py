"""New requests never share prefix-cache entries with requests started under other weights."""

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
