"""`asyncrl rollout` checks the job (input files, GPU plan, model) on its own settings while the learner starts, and
uses that check when the learner's shared settings turn out to be the same; otherwise, or when its own settings did
not pass (they may be the learner's to give), it checks the adopted settings, whose error is the command's."""

import logging

import pytest

from asyncrl.config import ConfigError, load_config
from launch.commands import rollout

log = logging.getLogger("test")


@pytest.fixture
def checks(monkeypatch):
    """`_checked` counted, passing where the train file is `good.parquet`; the plan is the config's train file."""
    calls = []

    def checked(config, _log):
        calls.append(config.data.train_files)
        if config.data.train_files != ["good.parquet"]:
            raise ConfigError(f"input files not found: {config.data.train_files}")
        config.rollout.weight_sync.backend = "gloo"  # as the placement resolves `auto`
        return "plan"

    monkeypatch.setattr(rollout, "_checked", checked)
    return calls


def test_own_settings_that_pass_and_match_the_learners_are_checked_once_before_the_learner_is_up(checks):
    own = load_config(None, ["data.train_files=[good.parquet]"])
    early = rollout._checked_early(own, log)
    assert own.rollout.weight_sync.backend == "auto"  # the check ran on a copy
    config, plan = rollout._settled(own, load_config(None, ["data.train_files=[good.parquet]"]), early, log)
    assert (config.rollout.weight_sync.backend, plan) == ("gloo", "plan")
    assert checks == [["good.parquet"]]


def test_settings_the_learner_changes_are_checked_again_as_adopted(checks):
    own = load_config(None, ["data.train_files=[good.parquet]"])
    adopted = load_config(None, ["data.train_files=[other.parquet]"])
    with pytest.raises(ConfigError, match="other.parquet"):  # the adopted check's error is the command's
        rollout._settled(own, adopted, rollout._checked_early(own, log), log)
    assert checks == [["good.parquet"], ["other.parquet"]]


def test_own_settings_that_fail_early_wait_for_the_learners(checks):
    own = load_config(None, ["data.train_files=[missing.parquet]"])
    early = rollout._checked_early(own, log)  # no error yet: the learner may give the files
    assert early.config is None
    config, plan = rollout._settled(own, load_config(None, ["data.train_files=[good.parquet]"]), early, log)
    assert (config.data.train_files, plan) == (["good.parquet"], "plan")
    assert checks == [["missing.parquet"], ["good.parquet"]]
