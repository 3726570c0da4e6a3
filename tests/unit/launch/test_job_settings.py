"""`asyncrl rollout` takes the job's shared settings from the learner's config, refuses an override that
contradicts them (naming the key), and reports its own settings as applied."""

import logging

import pytest

from asyncrl.config import ConfigError, load_config, save_config
from launch.job_settings import adopt_learner_settings

log = logging.getLogger("test")


@pytest.fixture
def run_dir(tmp_path):
    learner = load_config(None, ["learner.total_steps=40", "data.train_files=[a.parquet]", "validation.every=5",
                                 "run.gpu_memory_gib=80"])
    save_config(learner, tmp_path)
    return tmp_path


def test_shared_settings_come_from_the_learner_and_rollout_settings_stay(run_dir, caplog):
    overrides = ["rollout.num_servers=2", "rollout.engine.cpu_threads=1", "learner.lr=0.5", "run.log_level=INFO"]
    mine = load_config(None, overrides)
    with caplog.at_level(logging.INFO, logger="test"):
        adopted = adopt_learner_settings(mine, run_dir, overrides, log)
    assert adopted.learner.total_steps == 40 and adopted.data.train_files == ["a.parquet"]
    assert adopted.validation.every == 5
    assert adopted.run.gpu_memory_gib == 80  # both sides plan in the same GPU budget
    assert adopted.rollout.num_servers == 2 and adopted.rollout.engine.cpu_threads == 1  # its own
    assert adopted.learner.lr == mine.learner.lr  # not a shared setting: untouched
    assert "learner.total_steps=40" in caplog.text
    assert "rollout settings applied: rollout.num_servers=2, rollout.engine.cpu_threads=1" in caplog.text
    assert "have no effect there: learner.lr" in caplog.text
    assert "run.log_level" not in caplog.text  # the learner's value too: no news


def test_an_override_contradicting_the_learner_is_refused_naming_the_key(run_dir):
    overrides = ["learner.total_steps=200", "rollout.sampling.temperature=1.0"]  # the second agrees: default
    with pytest.raises(ConfigError, match=r"learner.total_steps: 200 given here, 40 in the learner's config") as error:
        adopt_learner_settings(load_config(None, overrides), run_dir, overrides, log)
    assert "rollout.sampling.temperature" not in str(error.value)


def test_without_a_learner_config_the_commands_own_settings_hold(tmp_path):
    mine = load_config(None, ["learner.total_steps=7"])
    assert adopt_learner_settings(mine, tmp_path, ["learner.total_steps=7"], log) == mine
