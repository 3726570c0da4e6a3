"""`asyncrl evaluate` before it starts an engine: which snapshots of a run are left to score, and the runs it refuses
to score together, each refusal naming what is wrong."""

import json
from pathlib import Path

import pytest

from asyncrl.config import load_config, save_config
from asyncrl.snapshots import EVALUATION_FILE, INDEX_FILE, SNAPSHOTS_DIR
from launch.commands.evaluate import engine_mismatch, read_run

VALIDATED = ["data.val_files=[v.parquet]", "validation.every=2", "validation.after_run=true",
             "learner.mode=synchronous"]


def run_dir(root: Path, name: str, made: list[int], scored: list[int] = (), *overrides: str) -> Path:
    directory = root / name
    save_config(load_config(None, [*VALIDATED, *overrides]), directory)
    (directory / SNAPSHOTS_DIR).mkdir()
    (directory / SNAPSHOTS_DIR / INDEX_FILE).write_text("".join(
        json.dumps({"version": v, "made_at": 100.0 + v}) + "\n" for v in made))
    (directory / EVALUATION_FILE).write_text("".join(json.dumps({"version": v}) + "\n" for v in scored))
    return directory


def test_only_the_snapshots_not_scored_yet_are_left(tmp_path):
    run = read_run(run_dir(tmp_path, "a", made=[0, 2, 4, 5], scored=[0, 2]))
    assert run.pending == [4, 5]


def test_a_directory_without_a_config_or_without_snapshots_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="no config.yaml"):
        read_run(tmp_path)
    with pytest.raises(SystemExit, match="validation.after_run=true"):
        read_run(run_dir(tmp_path, "b", made=[]))


def test_runs_share_one_engine_unless_an_engine_setting_differs(tmp_path):
    first = read_run(run_dir(tmp_path, "sync", made=[0]))
    lowered = read_run(run_dir(tmp_path, "async", [0], [], "rollout.engine.gpu_memory_utilization=0.4"))
    other_model = read_run(run_dir(tmp_path, "other", [0], [], "model.dtype=bfloat16"))
    assert engine_mismatch([first, lowered]) is None  # a memory share a plan lowered: the evaluator runs alone
    problem = engine_mismatch([first, lowered, other_model])
    assert "differ in model" in problem and "other" in problem
