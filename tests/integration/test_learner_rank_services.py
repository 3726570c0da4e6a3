"""Rank 0's services and a peer's in a two-rank gloo world: the peer trains on rank 0's batch and takes rank 0's
guard decision (a rollback, then going on), without reading the buffer or judging any metric itself."""

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.config import load_config
from asyncrl.messages import Batch
from learner.distributed import spawner_store
from learner_helpers import end_rank, random_groups, spawned_rank_world

pytestmark = pytest.mark.slow

SCORE = "critic/score/mean"
GUARD = ["guard.enabled=true", f"guard.watch=[{{name: {SCORE}, max_drop: 0.5}}]", "guard.rollback_steps=1",
         "learner.checkpoint_every=2", "learner.keep_checkpoints=2", "buffer.max_staleness=1", "model.dtype=float32"]


def rank_main(rank: int, port: int, run_dir: str) -> None:
    from learner.loop_state import LoopState
    from learner.services.rank_services import PeerServices, RankZeroServices
    from offline_learner import OfflineConnections

    config, model, state = load_config(None, GUARD), torch.nn.Linear(2, 1), LoopState(max_staleness=1)
    connections = OfflineConnections(lambda version, max_staleness: Batch(random_groups(version), [7, 8], next_offset=9))
    world = spawned_rank_world(rank, 2, port)
    if world.is_main:
        services = RankZeroServices.build(connections, config, Path(run_dir), world, model, state)
        services.guard.observe(2, {SCORE: 1.0})
        services.guard.observe(3, {SCORE: 0.1})  # collapsed: back to checkpoint 2
    else:
        services = PeerServices.build(config, world, model, state)
    batch = services.next_batch(3, 1)
    decisions = [services.guard_decision(), services.guard_decision()]
    seen = {"groups": [group.group_id for group in batch.groups], "offsets": batch.offsets,
            "decisions": [repr(decision) for decision in decisions]}
    Path(run_dir, f"rank{rank}.json").write_text(json.dumps(seen))
    end_rank()  # with its peer, and without the teardown that aborted now and then


def test_a_peer_takes_rank_zeros_batch_and_guard_decision(tmp_path):
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000002" / "meta.json").write_text(json.dumps({"step": 2}))
    store = spawner_store(2)
    mp.start_processes(rank_main, args=(store.port, str(tmp_path)), nprocs=2, start_method="spawn")
    zero, one = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert one["groups"] == zero["groups"] == [group.group_id for group in random_groups(3)]
    assert one["offsets"] == zero["offsets"] == [7, 8]
    assert one["decisions"] == zero["decisions"]
    rollback, after = zero["decisions"]
    # K = 1: version 4 may still train samples of version 3, version 5 none
    assert rollback.startswith("RollBack(") and "checkpoint_step=2" in rollback and "version=5" in rollback
    assert after == "GoOn()"
