"""check_input_files: `asyncrl run` and `asyncrl rollout` name every missing input file before starting a role."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch.commands.common import check_input_files
from asyncrl.config import ConfigError, load_config


def config_with(tmp_path: Path, *overrides: str):
    return load_config(None, [f"data.train_files=[{tmp_path / 'train.jsonl'}]",
                              f"data.val_files=[{tmp_path / 'val.jsonl'}]", *overrides])


def test_every_missing_file_is_named_with_its_key(tmp_path):
    (tmp_path / "train.jsonl").write_text("{}\n")
    config = config_with(tmp_path, "validation.every=10", f"reward.custom_fn.path={tmp_path / 'reward.py'}")
    with pytest.raises(ConfigError) as raised:
        check_input_files(config)
    assert str(raised.value).splitlines()[1:] == [f"  data.val_files: no file at {tmp_path / 'val.jsonl'}",
                                                  f"  reward.custom_fn.path: no file at {tmp_path / 'reward.py'}"]


def test_files_that_are_there_pass_and_unread_ones_are_not_asked_for(tmp_path):
    (tmp_path / "train.jsonl").write_text("{}\n")
    check_input_files(config_with(tmp_path, "validation.every=0"))  # no validation: val files are not read


def test_run_stops_at_once_with_the_key_and_starts_no_role(tmp_path):
    missing = tmp_path / "missing.parquet"
    done = subprocess.run([sys.executable, "-m", "launch.cli", "run", f"run.root_dir={tmp_path / 'runs'}",
                           f"data.train_files=[{missing}]"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"data.train_files: no file at {missing}" in done.stderr
    assert not (tmp_path / "runs").exists()  # no run directory, so no learner or rollout was started
