"""The learner's compiled layers put into this host's caches before a benchmark's runs: the job's policy loaded as a
learner rank loads it (`PolicyTrainer.load`: weights, FSDP2, the passes planned), then random tokens through it as a
training step runs them (packed or padded, the planned checkpointing mode; without gradients, then with). With
`learner.compile=true` each decoder layer compiles there, and torch keeps the result in its caches on this host
(Inductor's FX graph and AOTAutograd caches), so that a job started later loads the graphs instead of compiling them.
Without it the first mode of a race paid the compile on its clock: on one H100 the compiled synchronous run took
72.6 s from its launch to its first step, the async run after it 43.5 s (2026-12-07); on the 2-core CPU box this
warm-up of a two-layer tiny model took 41.5 s, then 11.9 s run again. scripts/bench_time_to_score.py runs it when the
race's config compiles the learner; it measures nothing but the seconds it took.

    python scripts/learner_warm_up.py --config configs/gpu_longtail.yaml learner.compile=true
"""

from __future__ import annotations

import argparse
import time

import torch

from asyncrl.config import AsyncRLConfig, load_config
from asyncrl.config_arguments import add_config_arguments
from learner.distributed import World, init_single_rank_world
from learner.maths.logprobs import target_logprobs
from learner.policy.memory import PROBE_SAMPLE_TOKENS, PROBE_TOKENS, random_rows
from learner.policy.policy_trainer import PolicyTrainer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "configs/gpu_longtail.yaml")
    return parser.parse_args()


def warm_up(config: AsyncRLConfig, world: World) -> float:
    """Load the policy as a one-rank learner (`world`) and run a training step's passes through it; the seconds it
    took."""
    started = time.perf_counter()
    step_passes(PolicyTrainer.load(config, world))
    return time.perf_counter() - started


def step_passes(trainer: PolicyTrainer) -> None:
    """The first probe's random tokens through the policy as a training step runs them: a forward without gradients
    (the step's pre-update log-probs), then a forward and backward (`learner.policy.memory`'s probes run that one when
    the plan is `auto`; a configured plan runs none), the gradients dropped after."""
    model, packed = trainer.model, trainer.passes.packed
    sample = min(PROBE_SAMPLE_TOKENS, model.config.max_position_embeddings)
    input_ids, attention_mask = random_rows(PROBE_TOKENS[0], sample, model.config.vocab_size, trainer.world.device)
    with torch.no_grad():
        target_logprobs(model, input_ids, attention_mask, with_entropy=False, packed=packed)
    logprobs, _ = target_logprobs(model, input_ids, attention_mask, packed=packed)  # [rows, sample-1]
    logprobs.mean().backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    args = parse_args()
    config = load_config(args.config, args.overrides)
    seconds = warm_up(config, init_single_rank_world(config.learner.device))
    cached = "its compiled layers are in this host's caches now" if config.learner.compile else \
        "learner.compile is off: nothing was compiled"
    print(f"the learner loaded and ran its passes in {seconds:.1f}s: {cached}", flush=True)


if __name__ == "__main__":
    main()
