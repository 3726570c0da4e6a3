"""What each rank's services do for the loop: rank 0 fetches, shares the weights when due, publishes the version and
logs a record built in a fixed order (the guard sees what the servers and the task weights added), drains and
commits; a peer rank reads and sends nothing, adds nothing to the record and keeps its K. The model here is a
plain module on one process: gathering its weights needs no collective, so a peer needs no process group.
(The collectives between rank 0 and a peer: tests/integration/test_learner_rank_services.py.)"""

import logging
from types import SimpleNamespace

import torch

from asyncrl.config import load_config
from asyncrl.config.guard import GuardConfig, WatchedMetricConfig
from asyncrl.messages import Batch
from learner.distributed import World
from learner.loop_state import LoopState
from learner.services.guard import GO_ON, Drained, NoGuard, RollBack, SafetyGuard
from learner.services.pacing import FixedStaleness
from learner.services.rank_services import PeerServices, RankZeroServices
from learner.services.task_weight_publisher import FixedTaskWeights
from learner.services.weight_sharing import WeightSharing
from offline_learner import OfflineConnections

CPU = torch.device("cpu")
TOKENS = "rollout/tokens_per_s"  # a metric only the servers' telemetry adds
ROLLBACK = RollBack(reason="collapse", checkpoint="step_6", checkpoint_step=6, collapsed_step=9, max_staleness=2,
                    version=12, lr_scale=0.5, rollback=1, max_rollbacks=1)


class ServingConnections(OfflineConnections):
    """Servers that report their throughput, and two validation passes that arrive together at the final wait."""

    def final_validation(self, version: int) -> list[dict[str, float]]:
        return [{"val/score/mean": 0.6, "val/version": 3.0}, {"val/score/mean": 0.7, "val/version": 4.0}]

    def server_metrics(self, version: int) -> dict[str, float]:
        return {TOKENS: 100.0}


def batch(offset: int) -> Batch:
    return Batch(groups=[SimpleNamespace(trajectories=[0, 1])] * 2, offsets=[offset, offset + 1], next_offset=offset + 2,
                 dropped_stale=1, next_ahead=[offset + 4])


def model_of(value: float) -> torch.nn.Module:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def rank_zero(guard, connections=None) -> tuple[RankZeroServices, OfflineConnections]:
    config = load_config(None, ["learner.total_steps=4", "learner.sync_every=2", "model.dtype=float32"])
    world = World(rank=0, size=1, device=CPU)
    connections = connections or OfflineConnections(lambda version, max_staleness: batch(10 * version))
    model = model_of(3.0)
    services = RankZeroServices(config, world, connections, WeightSharing(config, model, world, connections),
                                FixedTaskWeights({"weights": [1.0]}), guard, FixedStaleness(2))
    return services, connections


def peer() -> PeerServices:
    config = load_config(None, ["learner.total_steps=4", "learner.sync_every=2", "model.dtype=float32"])
    world = World(rank=1, size=2, device=CPU)  # no process group: anything a peer sent or received would fail
    return PeerServices.build(config, world, model_of(3.0), LoopState(max_staleness=3))


def test_rank_zero_shares_the_weights_when_due_publishes_each_version_and_logs_each_record(caplog):
    services, connections = rank_zero(NoGuard(), ServingConnections(lambda version, max_staleness: batch(0)))
    services.begin(0)
    assert connections.rounds == [(0, 6.0)] and connections.published == []  # the first weights, before any step
    with caplog.at_level(logging.INFO, logger="learner.services.rank_services"):
        for version in range(1, 5):
            services.after_step(version, {"critic/score/mean": 0.5, "timing_s/step": 1.0})
    assert connections.rounds == [(0, 6.0), (2, 6.0), (4, 6.0)]  # learner.sync_every=2
    assert connections.published == [1, 2, 3, 4]
    first, second, last = connections.logged[1], connections.logged[2], connections.logged[4]
    assert sorted(first) == ["critic/score/mean", TOKENS, "timing_s/elapsed", "timing_s/step"]
    assert second["weight_sync/version_sent"] == 2.0 and "weight_sync/version_sent" not in first
    assert last["val/score/mean"] == 0.7 and "val/score/mean" not in second  # validation waited for at the end only
    assert [record for version, record in connections.records if version == 4][0] == {"val/score/mean": 0.6,
                                                                                      "val/version": 3.0}
    assert caplog.messages[-1] == "step 4/4 reward 0.500 val 0.700 gen_tok/s 100 sync_s 0.000 step_s 1.000"


def test_the_guard_sees_what_the_servers_added_to_the_record(tmp_path):
    settings = GuardConfig(enabled=True, window=2, rollback_steps=1, watch=[WatchedMetricConfig(TOKENS, max_drop=0.5)])
    guard = SafetyGuard(settings, max_staleness=2, checkpoints=tmp_path, reach=4, saved={})
    services, connections = rank_zero(guard, ServingConnections(lambda version, max_staleness: batch(0)))
    services.begin(0)
    services.after_step(1, {})
    assert guard.detector.history[TOKENS] == [(1, 100.0)]
    assert connections.logged[1]["guard/collapse"] == 0.0  # the guard's own metrics are in the record too


def test_rank_zero_hands_out_its_batches_drains_commits_and_checkpoints_its_parts(tmp_path):
    guard = SafetyGuard(GuardConfig(enabled=True, watch=[WatchedMetricConfig("critic/score/mean")]), max_staleness=2,
                        checkpoints=tmp_path, reach=4, saved={"rollbacks": 1})
    services, connections = rank_zero(guard)
    assert services.next_batch(3, 2).offsets == [30, 31]
    assert services.max_staleness == 2 and services.pace(1, {}) == 2  # a fixed buffer.max_staleness
    # 3 batches at the collapsed version 9: batch(90) each time; 2 groups of 2 samples, and one dropped stale
    assert services.drain(ROLLBACK, offset=5, ahead=[]) == Drained(samples=12, groups=9, next_offset=92, next_ahead=[94])
    services.committed(4, 92, [94])
    assert connections.commits == [(4, 92, [94])]
    assert services.checkpoint_meta() == {"task_weights": {"weights": [1.0]}, "guard": guard.state_dict()}
    assert services.checkpoint_meta()["guard"]["rollbacks"] == 1
    services.finish(4)
    assert connections.finished_at == 4
    assert services.guard_decision() is GO_ON  # nothing observed: nothing collapsed


def test_a_peer_adds_nothing_reads_nothing_and_keeps_its_k():
    services = peer()
    services.begin(0)
    record = {"critic/score/mean": 0.5}
    for version in range(1, 5):
        services.after_step(version, record)
    assert record == {"critic/score/mean": 0.5}  # rank 0 alone builds and logs the record
    assert services.max_staleness == 3 and services.pace(1, {"timing_s/wait_batch": 9.0}) == 3
    assert services.drain(ROLLBACK, offset=5, ahead=[7]) == Drained(samples=0, groups=0, next_offset=5, next_ahead=[7])
    assert services.rolled_back(ROLLBACK, Drained(0, 0, 5, [7])) == 0
    assert services.checkpoint_meta() == {}  # rank 0 writes the checkpoint's metadata
    assert services.guard_decision() is GO_ON  # guard off: no decision to receive
