"""The learner's compiled layers put into this host's caches before a benchmark's runs: the job's policy loaded as a
learner rank loads it (`PolicyTrainer.load`: weights, FSDP2, the passes planned), then one forward and backward of
random tokens as a training pass runs them (packed or padded, the planned checkpointing mode). With
`learner.compile=true` each decoder layer compiles there, and torch keeps the result in its caches on this host
(Inductor's FX graph and AOTAutograd caches), so that a job started later loads the graphs instead of compiling them.
Without it the first mode of a race paid the compile on its clock: on one H100 the compiled synchronous run took
72.6 s from its launch to its first step, the async run after it 43.5 s (2026-12-07). scripts/bench_time_to_score.py
runs it when the race's config compiles the learner; it measures nothing but the seconds it took.

    python scripts/learner_warm_up.py --config configs/gpu_longtail.yaml learner.compile=true
"""

from __future__ import annotations

import argparse
import time

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
    """Load the policy as a one-rank learner (`world`) and run one training-shaped pass through it; the seconds it
    took."""
    started = time.perf_counter()
    one_pass(PolicyTrainer.load(config, world))
    return time.perf_counter() - started


def one_pass(trainer: PolicyTrainer) -> None:
    """A forward and backward of the first probe's random tokens through the policy as the trainer's passes run
    (`learner.policy.memory`'s probes run the same when the plan is `auto`; a configured plan runs none), gradients
    dropped after."""
    model = trainer.model
    sample = min(PROBE_SAMPLE_TOKENS, model.config.max_position_embeddings)
    input_ids, attention_mask = random_rows(PROBE_TOKENS[0], sample, model.config.vocab_size, trainer.world.device)
    logprobs, _ = target_logprobs(model, input_ids, attention_mask, packed=trainer.passes.packed)  # [rows, sample-1]
    logprobs.mean().backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    args = parse_args()
    config = load_config(args.config, args.overrides)
    seconds = warm_up(config, init_single_rank_world(config.learner.device))
    print(f"the learner loaded and ran a pass in {seconds:.1f}s (learner.compile={config.learner.compile}): its "
          "compiled layers are in this host's caches now", flush=True)


if __name__ == "__main__":
    main()
