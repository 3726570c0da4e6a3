"""The safety guard's decisions on hand-computed metric sequences: what counts as a collapse, which checkpoint
it rolls back to, the version training goes on from, its saved state, and when it stops the run instead; and the
loop carrying out a rollback. (A rollback on a real job is tests/integration/test_task_weights_run.py.)"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.config.guard import GuardConfig, WatchedMetricConfig
from asyncrl.config.loader import ConfigError
from asyncrl.messages import Batch
from learner.distributed import World
from asyncrl.staleness import drained_version
from learner.loop import roll_back
from learner.loop_state import LoopState
from learner.policy.policy_trainer import PolicyTrainer
from learner.policy.train_step import Passes
from learner.services.guard import GO_ON, CollapseDetector, Drained, RollBack, SafetyGuard, Stop
from learner.services.pacing import FixedStaleness
from learner.services.rank_services import RankZeroServices
from learner.services.task_weight_publisher import FixedTaskWeights
from learner.services.weight_sharing import WeightSharing
from offline_learner import OfflineConnections

SCORE, KL = "val/a/score/mean", "actor/kl"
SETTINGS = GuardConfig(enabled=True, window=3, rollback_steps=3, lr_scale=0.5, max_rollbacks=1,
                       watch=[WatchedMetricConfig(SCORE, max_drop=0.3),
                              WatchedMetricConfig(KL, higher_is_better=False, max_drop=1.0)])
ALONE = World(rank=0, size=1, device=torch.device("cpu"))


def first_collapse(values: list[dict[str, float]], settings: GuardConfig = SETTINGS):
    detector = CollapseDetector(settings, reach=4)
    for step, metrics in enumerate(values, start=1):
        if (found := detector.observe(step, metrics)) is not None:
            return found
    return None


def test_a_drop_beyond_the_threshold_against_the_recent_best_is_a_collapse():
    assert first_collapse([{SCORE: 1.0}, {SCORE: 0.9}, {SCORE: 0.75}]) is None  # 25 % below the best 1.0
    found = first_collapse([{SCORE: 1.0}, {SCORE: 0.9}, {SCORE: 0.8}, {SCORE: 0.65}])
    assert (found.step, found.metric, found.best) == (4, SCORE, 1.0) and found.drop == pytest.approx(0.35)


def test_the_best_is_recent_only():
    # by step 5 the window of 3 holds 0.8, 0.8, 0.8: 0.6 is 25 % below it, no collapse although 40 % below 1.0
    assert first_collapse([{SCORE: 1.0}, {SCORE: 0.8}, {SCORE: 0.8}, {SCORE: 0.8}, {SCORE: 0.6}]) is None


def test_a_metric_that_should_stay_low_collapses_upwards_and_a_non_finite_value_always():
    found = first_collapse([{KL: 0.02}, {KL: 0.01}, {KL: 0.025}])  # 150 % above the lowest, 0.01
    assert (found.step, found.metric) == (3, KL) and found.drop == pytest.approx(1.5)
    assert first_collapse([{KL: 0.02}, {KL: 0.039}]) is None
    nan = first_collapse([{SCORE: 0.5}, {SCORE: math.nan}])
    assert nan.step == 2 and nan.drop == math.inf


def test_a_best_of_zero_and_steps_without_the_metric_trigger_nothing():
    assert first_collapse([{SCORE: 0.0}, {SCORE: -1.0}, {"critic/score/mean": 0.0}, {}]) is None


def guard_with_checkpoints(tmp_path, steps: list[int], saved: dict | None = None) -> SafetyGuard:
    for step in steps:
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "meta.json").write_text(json.dumps({"step": step}))
    (tmp_path / "step_00000009.partial").mkdir()  # an unfinished save is never rolled back to
    return SafetyGuard(SETTINGS, max_staleness=2, checkpoints=tmp_path, reach=8, saved=saved or {})


def test_a_collapse_names_the_newest_checkpoint_far_enough_back_in_the_logged_metrics(tmp_path):
    guard = guard_with_checkpoints(tmp_path, [4, 6, 8])
    for step, score in [(7, 1.0), (8, 1.0)]:
        assert guard.observe(step, {SCORE: score, "batch/samples": 16.0})["guard/collapse"] == 0.0
    logged = guard.observe(10, {SCORE: 0.5, "batch/samples": 16.0})
    assert logged == {"guard/rollbacks": 0.0, "guard/discarded_samples": 0.0, "guard/drained_groups": 0.0,
                      "guard/collapse": 1.0, "guard/drop": 0.5, "guard/rollback_to": 6.0}  # step_8 is only 2 steps back: rollback_steps is 3
    decision = guard.decide()
    assert decision.checkpoint == str(tmp_path / "step_00000006") and guard.decide() is GO_ON


def test_a_collapse_decides_a_rollback_past_the_bound_of_the_collapsed_step_and_the_decision_is_taken_once(tmp_path):
    guard = guard_with_checkpoints(tmp_path, [4, 6, 8], saved={"rollbacks": 0})
    guard.observe(7, {SCORE: 0.8, "batch/samples": 16.0})
    guard.observe(8, {SCORE: 1.0, "batch/samples": 16.0})
    assert guard.decide() is GO_ON  # nothing collapsed yet
    # the collapsed step's batch was taken under K = 1 (paced), not the guard's starting K of 2: versions 10 and 11
    # may still train samples of version 10, version 12 none; 2 batches are drained at version 10
    guard.observe(10, {SCORE: 0.6, "batch/samples": 16.0, "staleness/max_staleness": 1})
    decision = guard.decide()
    assert decision == RollBack(reason="val/a/score/mean = 0.6 at step 10, 40% worse than its recent best 1",
                                checkpoint=str(tmp_path / "step_00000006"), checkpoint_step=6, collapsed_step=10,
                                max_staleness=1, version=12, lr_scale=0.5, rollback=1, max_rollbacks=1)
    assert decision.drained_batches == 2
    assert guard.decide() is GO_ON  # the next step goes on unless it collapses again


def test_a_rollback_counts_what_it_discarded_and_forgets_what_it_undid(tmp_path):
    guard = guard_with_checkpoints(tmp_path, [4, 6, 8], saved={"discarded_samples": 5, "drained_groups": 1})
    for step, score in [(5, 1.0), (6, 1.0), (7, 0.9), (8, 1.0), (9, 0.2)]:
        guard.observe(step, {SCORE: score, "batch/samples": 2.0 * step})
    rollback = guard.decide()  # back to step 6; K = 2: version 12, 3 batches drained
    trained = guard.rolled_back(rollback, Drained(samples=30, groups=12, next_offset=0, next_ahead=[]))
    assert trained == 14 + 16 + 18  # the samples of steps 7, 8 and 9
    assert (guard.rollbacks, guard.discarded_samples, guard.drained_groups) == (1, 5 + 48 + 30, 1 + 12)
    kept = sorted(path.name for path in tmp_path.glob("step_*"))
    assert kept == ["step_00000004", "step_00000006", "step_00000009.partial"]  # step 8 was on the rolled-back branch
    assert guard.state_dict()["trained"] == [[5, 10], [6, 12]]
    assert guard.state_dict()["history"][SCORE] == [[5, 1.0], [6, 1.0]]
    assert guard.observe(10, {SCORE: 0.75})["guard/collapse"] == 0.0  # 25 % below the best kept, 1.0


def test_training_goes_on_past_the_drain_of_the_admission_window():
    assert drained_version(10, 0) == 11  # K = 0: one batch was admitted ahead
    assert drained_version(10, 2) == 13


def test_no_rollback_left_or_no_checkpoint_stops_the_run_with_the_reason(tmp_path):
    spent = guard_with_checkpoints(tmp_path, [4], saved={"rollbacks": 1})
    spent.observe(8, {SCORE: 1.0})
    spent.observe(9, {SCORE: 0.1})
    stop = spent.decide()
    assert isinstance(stop, Stop)
    assert re.search(r"val/a/score/mean = 0.1 at step 9, 90% worse .*1 rollbacks done \(guard.max_rollbacks\)", stop.reason)
    early = SafetyGuard(SETTINGS, max_staleness=2, checkpoints=tmp_path / "none", reach=8, saved={})
    early.observe(1, {SCORE: 1.0})
    early.observe(2, {SCORE: 0.1})
    stop = early.decide()
    assert isinstance(stop, Stop)
    assert re.search(r"no checkpoint 3 or more steps before it \(guard.rollback_steps\)", stop.reason)


def test_the_saved_state_keeps_the_count_the_bests_and_what_a_rollback_would_discard(tmp_path):
    guard = guard_with_checkpoints(tmp_path, [], saved={"rollbacks": 1, "discarded_samples": 32})
    for step in range(1, 12):
        guard.observe(step, {SCORE: 1.0, "batch/samples": float(step)})
    state = json.loads(json.dumps(guard.state_dict()))  # through meta.json
    assert state["trained"] == [[step, step] for step in range(4, 12)]  # the last `reach` (8) steps
    resumed = SafetyGuard(SETTINGS, max_staleness=2, checkpoints=tmp_path, reach=8, saved=state)
    assert resumed.observe(12, {SCORE: 0.6})["guard/rollbacks"] == 1.0  # 40 % below the resumed best: a collapse
    assert resumed.pending is not None and resumed.pending.best == 1.0


@pytest.mark.parametrize(("overrides", "problem"), [
    (["guard.watch=[]"], r"guard.watch: needs at least one metric"),
    (["guard.watch=[{max_drop: 0.2}]"], r"guard.watch\[0\].name: must name a logged metric"),
    (["guard.rollback_steps=5", "learner.checkpoint_every=2", "learner.keep_checkpoints=3"],
     r"guard.rollback_steps: 5 steps back needs .* = 4"),
    (["learner.mode=synchronous"], r"guard.enabled: the synchronous reference"),
])
def test_bad_guard_settings_are_refused_naming_the_key(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, ["guard.enabled=true", "guard.watch=[{name: critic/score/mean}]", "learner.checkpoint_every=5",
                           "learner.keep_checkpoints=3", *overrides])


@pytest.fixture
def alone_in_a_group(tmp_path):
    """A gloo process group of this one process: checkpoints are saved and loaded as on a learner rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield ALONE
    finally:
        dist.destroy_process_group()


def test_a_rollback_restores_the_checkpoint_drops_the_newer_ones_and_goes_on_past_the_bound(tmp_path, alone_in_a_group):
    from learner.policy.checkpoint import save_checkpoint

    root = tmp_path / "checkpoints"
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = SafetyGuard(SETTINGS, max_staleness=2, checkpoints=root, reach=8, saved={})
    saved_weights = {}
    for step in range(1, 10):
        with torch.no_grad():
            model.weight.fill_(float(step))  # the weights "trained" to step N are all N
        guard.observe(step, {SCORE: 1.0 if step < 9 else 0.2, "batch/samples": 10.0 * step})
        if step % 2 == 0:
            save_checkpoint(root, step, model, optimizer, {"task_weights": {"step": step}}, alone_in_a_group, keep=4)
            saved_weights[step] = model.weight.detach().clone()
    calls = []

    def fetch_batch(version: int, max_staleness: int) -> Batch:
        calls.append(("fetch", version, max_staleness))
        offset = 100 + 10 * len(calls)  # two groups of 3 samples and one group dropped as stale per batch
        return Batch(groups=[SimpleNamespace(trajectories=[0, 1, 2])] * 2, offsets=[offset, offset + 1],
                     next_offset=offset + 3, dropped_stale=1, next_ahead=[offset + 5])

    config = load_config(None, [])
    connections = OfflineConnections(fetch_batch)
    services = RankZeroServices(config, alone_in_a_group, connections,
                                WeightSharing(config, model, alone_in_a_group, connections), FixedTaskWeights({}), guard,
                                FixedStaleness(2))
    trainer = PolicyTrainer(config, alone_in_a_group, model, None, optimizer, Passes(4096), pad_id=0)
    state = LoopState(step=9, buffer_offset=100, lr_scale=0.5)
    roll_back(guard.decide(), state, trainer, services)
    # step 9 collapsed; 3 steps back is step 6; with K = 2 the batches of versions 10 and 11 were admitted already:
    # they are drained at version 9, and the restored weights go out as version 12
    assert torch.equal(model.weight, saved_weights[6])
    assert calls == [("fetch", 9, 2), ("fetch", 9, 2), ("fetch", 9, 2)]  # under the step's K
    assert connections.rounds == [(12, 12.0)] and connections.published == [12]  # the restored weights, as version 12
    assert (state.step, state.buffer_offset, state.buffer_ahead) == (12, 133, [135])  # past the drained batches
    assert (state.lr_scale, state.task_weights) == (0.25, {"step": 6})
    assert services.checkpoint_meta()["task_weights"] == {"step": 6}  # the next checkpoint keeps the restored ones
    assert sorted(path.name for path in root.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000006"]
    # the samples trained at steps 7, 8 and 9, and the 3 drained batches' 6 samples each
    assert (guard.discarded_samples, guard.drained_groups, guard.rollbacks) == (70 + 80 + 90 + 18, 9, 1)
    # the values of the rolled-back steps are forgotten: the window compares with what was measured up to step 6
    assert guard.state_dict()["history"][SCORE] == [[step, 1.0] for step in range(1, 7)]
