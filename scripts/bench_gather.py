"""The learner's weight gather for a sync when the weights go to CPU memory (models past
`rollout.weight_sync.staging_bytes`, e.g. 7B in bf16 against the 8 GiB default): fresh pageable copies
(the learner before, the baseline) against reused page-locked ones (`learner.policy.policy_model.PinnedWeights`),
side by side on the same sharded model.

The model is a randomly initialised Qwen2-architecture LM of a named shape (`--shape`, Qwen2.5's dimensions),
float32 master weights sharded with FSDP2 on one rank as the learner does; each round gathers every weight,
casts it to `--sync-dtype` (model.dtype) and copies it into CPU memory, as `learner.services.weight_sharing.WeightSharing` does
on rank 0 (a multi-rank learner adds the all-gather, which both variants share). The first round of each
variant is a warm-up (the pinned variant allocates its tensors there). Table: median, min and max seconds
per round; last line: RESULT {json} with gather_pageable_s, gather_pinned_s, pinned_speedup, bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench_learner import SHAPES, build_model, model_shape
from asyncrl.config.learner import LearnerConfig
from learner.distributed import init_single_rank_world
from learner.policy.policy_model import DTYPES, PinnedWeights, full_weights, full_weights_bytes, shard_policy


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES), help="model dimensions (Qwen2.5's)")
    parser.add_argument("--rounds", type=int, default=3, help="timed gathers per variant, after one warm-up")
    parser.add_argument("--sync-dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype sent to the servers")
    args = parser.parse_args()
    args.layers, args.dtype, args.seq_len, args.seed = 0, "float32", 4096, 0  # what build_model reads
    return args


def timed_gathers(model: torch.nn.Module, dtype: torch.dtype, rounds: int, pinned: PinnedWeights | None) -> list[float]:
    seconds = []
    for _ in range(rounds + 1):
        started = time.perf_counter()
        weights = full_weights(model, dtype, torch.device("cpu"), keep=True, pinned=pinned)
        seconds.append(time.perf_counter() - started)
        del weights  # as the coordinator releases the previous round's copy before the next gather
    return seconds[1:]


def main() -> None:
    args = parse_args()
    world = init_single_rank_world("cuda")
    model = shard_policy(build_model(model_shape(args), args, world, DTYPES[args.dtype]), LearnerConfig(), world)
    dtype = DTYPES[args.sync_dtype]
    measured = {"pageable (fresh copies, baseline)": timed_gathers(model, dtype, args.rounds, None),
                "pinned (reused)": timed_gathers(model, dtype, args.rounds, PinnedWeights())}
    print(f"{'gather into CPU memory':36} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, seconds in measured.items():
        print(f"{name:36} {statistics.median(seconds):9.3f} {min(seconds):7.3f} {max(seconds):7.3f}")
    pageable, pinned = (statistics.median(seconds) for seconds in measured.values())
    print("RESULT " + json.dumps({"shape": args.shape, "bytes": full_weights_bytes(model, dtype),
                                  "gather_pageable_s": round(pageable, 3), "gather_pinned_s": round(pinned, 3),
                                  "pinned_speedup": round(pageable / pinned, 2)}), flush=True)


if __name__ == "__main__":
    main()
