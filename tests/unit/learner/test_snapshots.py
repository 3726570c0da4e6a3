"""Weight snapshots for validation after the run: which versions are kept, what a snapshot holds, when it was made,
and the settings that cannot keep them."""

import json
import time

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.snapshots import INDEX_FILE, SNAPSHOTS_DIR, due_versions, made_times, snapshot_path
from learner.services.snapshots import SnapshotWriter


def test_the_due_versions_are_the_multiples_of_every_and_the_last():
    assert due_versions(every=4, final_version=10) == [0, 4, 8, 10]
    assert due_versions(every=5, final_version=10) == [0, 5, 10]
    assert due_versions(every=0, final_version=10) == []


def test_a_snapshot_holds_the_version_as_it_was_kept_and_the_time_it_was_made(tmp_path):
    writer = SnapshotWriter(tmp_path, every=2, final_version=3)
    embedding = torch.arange(6.0).reshape(3, 2)
    weights = [("embed.weight", embedding), ("lm_head.weight", embedding), ("norm.weight", torch.ones(2))]
    before = time.time()
    for version in range(4):
        writer.keep(version, weights)
        embedding.add_(1.0)  # training goes on: what was kept must not change
    writer.close()
    assert sorted(made_times(tmp_path)) == [0, 2, 3]  # 1 is not due
    assert before <= made_times(tmp_path)[0] <= made_times(tmp_path)[2] <= time.time()
    assert not snapshot_path(tmp_path, 1).exists()
    kept = torch.load(snapshot_path(tmp_path, 2), weights_only=True)
    assert [name for name, _ in kept] == ["embed.weight", "lm_head.weight", "norm.weight"]
    assert torch.equal(kept[0][1], torch.arange(6.0).reshape(3, 2) + 2)  # as it was at version 2
    assert kept[0][1] is kept[1][1]  # a tied weight is stored once


def test_a_version_made_again_counts_by_its_latest_line(tmp_path):
    (tmp_path / SNAPSHOTS_DIR).mkdir()
    lines = [{"version": 0, "made_at": 5.0}, {"version": 2, "made_at": 9.0}, {"version": 2, "made_at": 12.0}]
    (tmp_path / SNAPSHOTS_DIR / INDEX_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert made_times(tmp_path) == {0: 5.0, 2: 12.0}


@pytest.mark.parametrize("overrides, problem", [
    (["validation.after_run=true"], "needs validation.every > 0"),
    (["validation.after_run=true", "validation.every=3", "learner.sync_every=2"], "multiple of learner.sync_every=2"),
])
def test_settings_that_cannot_keep_every_due_version_are_refused_by_name(overrides, problem):
    with pytest.raises(ConfigError, match="validation.after_run") as error:
        load_config(None, ["data.val_files=[v.parquet]", *overrides])
    assert problem in str(error.value)


def test_after_run_takes_the_passes_out_of_the_job():
    during = load_config(None, ["data.val_files=[v.parquet]", "validation.every=2"]).validation
    after = load_config(None, ["data.val_files=[v.parquet]", "validation.every=2", "validation.after_run=true",
                               "learner.mode=synchronous", "learner.sync_every=3"]).validation
    assert during.during_run and not after.during_run
