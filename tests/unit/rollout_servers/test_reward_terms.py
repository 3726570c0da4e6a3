"""Rewards combined from several terms per task, and the per-task means of reward entries (train and val)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.config.loader import ConfigError
from asyncrl.config.sections import CustomRewardConfig, RewardConfig, RewardTermConfig
from rollout_servers.rewards import RewardFunctionError, RewardRequest, RewardScorer, UnknownDataSourceError, check_reward_setup
from rollout_servers.rewards.results import result_from_return
from rollout_servers.rewards.terms import RewardSpec, load_reward
from asyncrl.task_metrics import ScoredSample, task_reward_metrics, task_sample_counts
from asyncrl.validation_scores import PromptOutcome, validation_metrics

TERMS_FILE = Path(__file__).resolve().parents[2] / "fixtures" / "reward_terms.py"
PENALTY = -0.1  # weight of the length term


def terms_config(**custom) -> RewardConfig:
    """Task `calc`: correctness (the custom function, the default reward) plus PENALTY × response length."""
    return RewardConfig(
        custom_fn=CustomRewardConfig(path=str(TERMS_FILE), name=custom.get("name", "exact_with_acc")),
        terms=[RewardTermConfig(data_source="calc", name="correct"),
               RewardTermConfig(data_source="calc", name="length", path=str(TERMS_FILE), function="length",
                                weight=PENALTY)],
        num_workers=1,
    )


def score(config: RewardConfig, data_source: str, solution: str, answer: str = "42"):
    return result_from_return(load_reward(RewardSpec.from_config(config))(
        data_source=data_source, solution_str=solution, ground_truth=answer, extra_info=None))


def test_a_task_with_terms_gets_their_weighted_sum_and_each_term_in_its_info():
    result = score(terms_config(), "calc", "42")
    assert result.score == pytest.approx(1.0 + PENALTY * 2)  # correct 1, length 2 characters
    assert result.info == {"correct": 1.0, "correct/acc": 1.0, "length": 2.0}
    wrong = score(terms_config(), "calc", "4242")
    assert wrong.score == pytest.approx(0.0 + PENALTY * 4)
    assert wrong.info == {"correct": 0.0, "correct/acc": 0.0, "length": 4.0}


def test_a_task_without_terms_keeps_the_default_reward():
    result = score(terms_config(), "other", "42")
    assert (result.score, result.info) == (1.0, {"acc": 1.0})


def test_a_term_that_returns_no_number_fails_the_sample_naming_the_term():
    config = terms_config()
    config.terms[1].function = "not_a_number"
    with pytest.raises(ValueError, match=r"reward term 'length' \(reward.terms\[1\]\): reward function returned a str"):
        score(config, "calc", "42")


def test_terms_are_scored_in_the_worker_pool():
    with RewardScorer(terms_config()) as scorer:
        first, second = scorer.score([RewardRequest("calc", "42", "42"), RewardRequest("calc", "7", "42")])
    assert first.score == pytest.approx(0.8) and first.info["length"] == 2.0
    assert second.score == pytest.approx(-0.1) and second.info["correct"] == 0.0


def test_a_term_file_that_does_not_load_names_its_key(tmp_path):
    config = terms_config()
    config.terms[1].path = str(tmp_path / "missing.py")
    with pytest.raises(RewardFunctionError, match=r"reward.terms\[1\].path"):
        check_reward_setup(config, ["calc"])
    config.terms[1].path, config.terms[1].function = str(TERMS_FILE), "absent"
    with pytest.raises(RewardFunctionError, match=r"reward.terms\[1\].function: .* defines no 'absent'"):
        check_reward_setup(config, ["calc"])


def test_builtins_must_cover_only_the_tasks_that_use_the_default_reward():
    own_files = RewardConfig(terms=[RewardTermConfig(data_source="calc", name="length", path=str(TERMS_FILE),
                                                     function="length")])
    check_reward_setup(own_files, ["calc", "arithmetic"])  # calc is scored by its term alone
    with pytest.raises(UnknownDataSourceError, match="'trivia'"):
        check_reward_setup(own_files, ["calc", "trivia"])
    own_files.terms.append(RewardTermConfig(data_source="calc", name="correct"))  # now the built-in scores calc too
    with pytest.raises(UnknownDataSourceError, match="'calc'"):
        check_reward_setup(own_files, ["calc"])


@pytest.mark.parametrize(("terms", "problem"), [
    (["{data_source: calc, name: score}"], r"reward.terms\[0\].name: must be a non-empty name other than 'score'"),
    (["{data_source: calc, name: a}", "{data_source: calc, name: a}"], r"reward.terms\[1\].name: 'a' is used twice"),
    (["{name: a}"], r"reward.terms\[0\].data_source: must name the task"),
])
def test_bad_terms_are_refused_naming_the_key(terms, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, [f"reward.terms=[{','.join(terms)}]"])


def test_task_means_of_the_score_and_of_each_entry_where_present():
    samples = [ScoredSample("a", 1.0, {"acc": 1.0, "length": 4.0}), ScoredSample("a", 0.0, {"acc": 0.0}),
               ScoredSample("b", 0.5, {})]
    assert task_reward_metrics(samples, "critic") == {
        "critic/a/score/mean": 0.5, "critic/a/acc/mean": 0.5, "critic/a/length/mean": 4.0, "critic/b/score/mean": 0.5,
    }
    assert task_sample_counts(["a", "b", "a"]) == {"batch/a/samples": 2.0, "batch/b/samples": 1.0}


def test_validation_logs_the_reward_entries_per_task():
    outcomes = [PromptOutcome("a", [1.0, 0.0], [{"acc": 1.0}, {"acc": 0.0}]),
                PromptOutcome("a", [1.0, 1.0], [{"acc": 1.0}, {"acc": 1.0}]), PromptOutcome("b", [0.0, 0.0])]
    metrics = validation_metrics(outcomes, k=1)
    assert metrics["val/a/acc/mean"] == 0.75 and metrics["val/a/score/mean"] == 0.75
    assert metrics["val/b/score/mean"] == 0.0 and "val/b/acc/mean" not in metrics
