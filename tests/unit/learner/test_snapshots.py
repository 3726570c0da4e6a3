"""Weight snapshots for validation after the run: which versions are kept, what a snapshot holds, when it was made,
and the settings that cannot keep them."""

import json
import shutil
import time
from collections import namedtuple

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.snapshots import INDEX_FILE, SNAPSHOTS_DIR, due_versions, made_times, snapshot_path
from learner.services import snapshots
from learner.services.snapshots import SnapshotSpaceError, SnapshotWriter

Usage = namedtuple("Usage", "total used free")


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


def free_disk(monkeypatch, free_bytes: int) -> None:
    monkeypatch.setattr(snapshots.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - free_bytes, free_bytes))


def test_a_job_whose_due_snapshots_cannot_fit_the_disk_stops_at_its_first_one_naming_the_numbers(tmp_path, monkeypatch):
    weights = [("embed.weight", torch.zeros(256, 256)), ("lm_head.weight", None), ("norm.weight", torch.zeros(256))]
    weights[1] = ("lm_head.weight", weights[0][1])  # tied: stored once, counted once
    size = (256 * 256 + 256) * 4  # float32 bytes of one snapshot
    # versions 0, 5, ..., 100: 21 due; from version 10 on (a resumed job), 19
    free_disk(monkeypatch, 19 * size - 1)
    with pytest.raises(SnapshotSpaceError) as error:
        SnapshotWriter(tmp_path, every=5, final_version=100).keep(10, weights)
    assert "the 19 snapshots still due" in str(error.value) and "validation.every" in str(error.value)
    assert f"{(19 * size - 1) / 2**30:.1f} GiB free" in str(error.value)
    assert not made_times(tmp_path)  # nothing written
    free_disk(monkeypatch, 19 * size)  # room for exactly the snapshots due
    writer = SnapshotWriter(tmp_path, every=5, final_version=100)
    writer.keep(10, weights)
    free_disk(monkeypatch, 0)  # checked once, at the first snapshot: later ones are not refused
    writer.keep(15, weights)
    writer.close()
    assert sorted(made_times(tmp_path)) == [10, 15]


def test_the_room_is_read_where_the_snapshots_go(tmp_path, monkeypatch):
    asked, usage = [], shutil.disk_usage
    monkeypatch.setattr(snapshots.shutil, "disk_usage", lambda path: asked.append(path) or usage(path))
    writer = SnapshotWriter(tmp_path, every=1, final_version=1)
    writer.keep(0, [("w", torch.ones(2))])
    writer.close()
    assert asked == [tmp_path / SNAPSHOTS_DIR]


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
