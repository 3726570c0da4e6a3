"""Synthetic trajectory groups of a given shape, for benchmarks and tests of the transport and buffer."""

from __future__ import annotations

import random

import numpy as np

from asyncrl.messages import Trajectory, TrajectoryGroup

VOCAB_SIZE = 151_936  # Qwen2's vocabulary: realistic token-id widths on the wire
PROMPT_TOKENS = 64


def synthetic_group(record_id: str, *, samples: int = 1, completion_tokens: int = 1024, version: int = 0,
                    server_id: str = "synthetic", seed: int = 0) -> TrajectoryGroup:
    """A group whose trained tokens were all sampled at `version` (so its staleness is exact)."""
    rng = random.Random(f"{seed}:{record_id}")
    group_id = f"g-{record_id}"
    trajectories = [
        Trajectory(
            prompt_ids=[rng.randrange(VOCAB_SIZE) for _ in range(PROMPT_TOKENS)],
            completion_ids=[rng.randrange(VOCAB_SIZE) for _ in range(completion_tokens)],
            behaviour_logprobs=np.float32([-rng.random() for _ in range(completion_tokens)]).tolist(),  # as engines report
            token_versions=[version] * completion_tokens,
            loss_mask=[1] * completion_tokens,
            reward=float(rng.random() < 0.5),
            group_id=group_id,
            data_source="synthetic",
            finish_reason="length",
        )
        for _ in range(samples)
    ]
    return TrajectoryGroup(record_id=record_id, group_id=group_id, server_id=server_id, trajectories=trajectories)
