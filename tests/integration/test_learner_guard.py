"""The safety guard inside the learner's loop, in one process with a real model and real checkpoints (a scripted
buffer instead of the buffer service): a collapse rolls the weights back to the checkpoint before it, the
batches the collapsed policy was admitted to sample are drained, training goes on, and the collapse after the
last allowed rollback stops the run with its reason."""

import json

import pytest
import torch

from asyncrl.config import load_config
from learner.loop_state import LoopState
from learner.policy.checkpoint import CHECKPOINTS_DIR
from learner.policy.policy_model import load_policy
from learner.services.guard import GuardStopped
from learner_helpers import random_groups, save_tiny_model, single_rank_world
from offline_learner import OfflineConnections, run_offline
from test_learner_bad_steps import ScriptedBuffer, batch_of

pytestmark = pytest.mark.slow

SAMPLES_PER_BATCH = 4  # 2 groups of 2
COLLAPSED = {5, 10}  # scripted batches (1-based) whose rewards are all -1: the watched mean reward collapses


def scripted_batches(count: int):
    return [batch_of(random_groups(seed, reward=-1.0 if seed in COLLAPSED else None), 2 * seed) for seed in range(1, count + 1)]


def test_a_collapse_rolls_back_and_the_one_past_the_last_rollback_stops_the_run(tmp_path):
    config = load_config(overrides=[
        "learner.total_steps=20", "learner.lr=0.01", "learner.device=cpu", f"model.path={save_tiny_model(tmp_path / 'tiny')}",
        "learner.checkpoint_every=2", "learner.keep_checkpoints=3", "buffer.max_staleness=0", "guard.enabled=true",
        "guard.watch=[{name: critic/score/mean, max_drop: 0.5}]", "guard.rollback_steps=2", "guard.lr_scale=0.5",
        "guard.max_rollbacks=1",
    ])
    run_dir = tmp_path / "run"
    with single_rank_world() as world:
        model = load_policy(config.model.path, "float32", config.learner, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learner.lr)
        buffer = ScriptedBuffer(model, scripted_batches(12))
        connections = OfflineConnections(buffer)
        with pytest.raises(GuardStopped) as stopped:
            run_offline(config, run_dir, world, model, optimizer, LoopState(), connections)
    logged = connections.logged
    # batch 5 collapses step 5: back to checkpoint 2 (3 steps back at most: 4 is only 1 back); batch 6 is drained at
    # version 5 (K = 0: one batch was admitted ahead); training goes on from version 6 with batch 7
    assert buffer.versions == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sorted(logged) == [1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert logged[5]["guard/collapse"] == 1.0 and logged[5]["guard/rollback_to"] == 2.0
    for name, weight in buffer.weights_seen[6].items():  # what version 6 trained from: the weights after step 2
        assert torch.equal(weight, buffer.weights_seen[2][name]), name
    assert logged[7]["guard/rollbacks"] == 1.0 and logged[7]["actor/lr"] == pytest.approx(0.005)
    assert logged[7]["guard/discarded_samples"] == 3 * SAMPLES_PER_BATCH + SAMPLES_PER_BATCH  # steps 3-5, and batch 6
    # batch 10 collapses step 10 with no rollback left: the run stops, saying why
    assert "critic/score/mean = -1 at step 10" in str(stopped.value)
    assert "1 rollbacks done (guard.max_rollbacks): stopping the run" in str(stopped.value)
    kept = sorted(path.name for path in (run_dir / CHECKPOINTS_DIR).iterdir())
    assert kept == ["step_00000002", "step_00000006", "step_00000008"]  # 4 was on the rolled-back branch
    meta = json.loads((run_dir / CHECKPOINTS_DIR / "step_00000006" / "meta.json").read_text())
    # past the drained batch 6 (offsets 12 and 13)
    assert (meta["step"], meta["buffer_offset"], meta["lr_scale"], meta["guard"]["rollbacks"]) == (6, 14, 0.5, 1)
