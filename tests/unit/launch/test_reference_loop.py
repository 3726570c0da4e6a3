"""The synchronous reference's loop (launch/reference_loop.py) with stand-ins for its engine and policy
halves: the order of its steps, the weights' versions, what it records, and non-finite steps."""

import math
from dataclasses import dataclass, field

import pytest

from asyncrl.config import load_config
from asyncrl.config.sections import MetricsConfig
from asyncrl.messages import Trajectory, TrajectoryGroup
from asyncrl.metrics import MetricsLogger, read_metrics
from launch.reference_loop import frames, run, trained_groups
from learner.bad_steps import TooManyBadSteps


def group(number: int, version: int) -> TrajectoryGroup:
    samples = [Trajectory(prompt_ids=[1, 2], completion_ids=[3 + i] * (i + 1), behaviour_logprobs=[-0.5] * (i + 1),
                          token_versions=[version] * (i + 1), loss_mask=[1] * (i + 1), reward=float(i),
                          group_id=f"g{number}", data_source="test", finish_reason="stop") for i in range(2)]
    return TrajectoryGroup(f"g{number}", f"g{number}", "sync", samples)


@dataclass
class Outcome:
    metrics: dict[str, float]
    finite: bool = True


@dataclass
class FakeHalves:
    """Both halves in one: records the calls the loop makes; a step's loss is not finite where listed."""

    non_finite: set[int] = field(default_factory=set)  # train calls (0-based) whose loss is not finite
    due: set[int] = field(default_factory=set)  # versions a validation pass is due at
    calls: list[tuple] = field(default_factory=list)
    version: int = 0  # of the weights the fake engine holds
    weights_device: str = "cpu"
    is_main: bool = True  # a one-rank run's only rank

    def gathered(self, payload: bytes) -> list[bytes]:
        return [payload]  # one rank: its share is the batch

    def sample(self) -> list[TrajectoryGroup]:
        self.calls.append(("sample", self.version))
        return [group(len(self.calls), self.version)]

    def train(self, groups: list[TrajectoryGroup], version: int) -> Outcome:
        finite = sum(call[0] == "train" for call in self.calls) not in self.non_finite
        self.calls.append(("train", version))
        return Outcome({"actor/pg_loss": 0.25 if finite else math.nan, "actor/grad_norm": 1.0}, finite)

    def weights(self, device: str) -> list[tuple[str, float]]:
        return [("w", 1.0)]

    def load_weights(self, version: int, weights) -> float:
        self.calls.append(("load", version))
        self.version = version
        return 0.01

    def validate(self, gathered) -> dict[str, float]:
        if self.version not in self.due:
            return {}
        self.calls.append(("validate", self.version))
        gathered(b"")  # a pass is pooled from every rank's share
        return {"val/score/mean": self.version / 10, "val/version": float(self.version), "val/seconds": 0.5}


def reference(tmp_path, halves: FakeHalves, steps: int = 2, *overrides: str) -> int:
    config = load_config(None, [f"learner.total_steps={steps}", "learner.max_bad_steps=2", *overrides])
    metrics = MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"))
    try:
        return run(config, tmp_path, halves, halves, metrics)
    finally:
        metrics.close()


def test_each_step_samples_with_the_current_weights_trains_then_loads_the_next(tmp_path):
    halves = FakeHalves()
    assert reference(tmp_path, halves) == 2
    assert halves.calls == [("sample", 0), ("train", 0), ("load", 1), ("sample", 1), ("train", 1), ("load", 2)]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert [r["staleness/max"] for r in records] == [0.0, 0.0]
    assert records[0]["batch/samples"] == 2 and records[0]["batch/tokens"] == 3 and records[0]["critic/score/mean"] == 0.5
    assert records[0]["weight_sync/server_pause_seconds"] == 0.01
    assert trained_groups(tmp_path, 2) == [group(4, 1)]  # the groups the step trained on, read back


def test_due_versions_are_validated_once_their_weights_are_loaded_and_logged_with_the_step_that_made_them(tmp_path):
    halves = FakeHalves(due={0, 2})
    assert reference(tmp_path, halves, steps=3) == 3
    assert halves.calls == [("validate", 0), ("sample", 0), ("train", 0), ("load", 1), ("sample", 1), ("train", 1),
                            ("load", 2), ("validate", 2), ("sample", 2), ("train", 2), ("load", 3)]
    records = read_metrics(tmp_path)
    assert [(r["step"], r.get("val/version"), r.get("val/score/mean")) for r in records] == [
        (0, 0.0, 0.0), (1, None, None), (2, 2.0, 0.2), (3, None, None)]
    assert "batch/samples" not in records[0]  # version 0's pass alone: no step trained it
    assert records[2]["batch/samples"] == 2 and records[2]["val/seconds"] == 0.5


def test_a_non_finite_step_keeps_the_weights_and_too_many_stop_the_run(tmp_path):
    halves = FakeHalves(non_finite={0})
    reference(tmp_path, halves, steps=1)
    assert halves.calls == [("sample", 0), ("train", 0), ("sample", 0), ("train", 0), ("load", 1)]
    with pytest.raises(TooManyBadSteps):
        reference(tmp_path / "again", FakeHalves(non_finite={0, 1}), steps=1)


@dataclass
class Rank1(FakeHalves):
    """A second colocated rank: its share of the batch is pooled with rank 0's (one more group ahead of its own)."""

    is_main: bool = False

    def gathered(self, payload: bytes) -> list[bytes]:
        self.calls.append(("gather", self.version))
        return [frames([group(0, self.version)]), payload]

    def weights(self, device: str) -> list[tuple[str, float]]:
        self.calls.append(("weights", self.version))
        return [("w", 1.0)]


def test_another_rank_takes_its_part_in_each_due_pass_but_records_nothing(tmp_path):
    halves = Rank1(due={0, 2})
    assert run(load_config(None, ["learner.total_steps=2"]), tmp_path, halves, halves, None) == 2
    assert halves.calls == [("validate", 0), ("gather", 0),  # its share of version 0's pass, pooled
                            ("sample", 0), ("gather", 0), ("train", 0), ("weights", 0), ("load", 1),
                            ("sample", 1), ("gather", 1), ("train", 1), ("weights", 1), ("load", 2),
                            ("validate", 2), ("gather", 2)]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "trained").exists()


def test_with_passes_after_the_run_another_rank_gathers_each_version_for_the_snapshots_and_records_nothing(tmp_path):
    halves = Rank1()  # validation.after_run: no pass is due in the job
    config = load_config(None, ["learner.total_steps=2", "validation.every=1", "validation.after_run=true",
                                "data.val_files=[v.parquet]"])
    assert run(config, tmp_path, halves, halves, None) == 2
    assert halves.calls == [("weights", 0),  # version 0's weights for rank 0's snapshot: gathering them is collective
                            ("sample", 0), ("gather", 0), ("train", 0), ("weights", 0), ("load", 1),
                            ("sample", 1), ("gather", 1), ("train", 1), ("weights", 1), ("load", 2)]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "trained").exists()


def test_rank_0_records_the_pooled_batch_in_rank_order(tmp_path):
    halves = Rank1(is_main=True)
    reference(tmp_path, halves, 1)
    assert trained_groups(tmp_path, 1) == [group(0, 0), group(1, 0)]  # the other rank's group, then its own
    assert read_metrics(tmp_path)[0]["batch/samples"] == 4
