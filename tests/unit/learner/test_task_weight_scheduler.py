"""Dynamic task weights: the scheduler's rule on hand-computed steps, its checkpoint state, the naming of
tasks from files, the mixture drawing with changed weights, and the config checks."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from asyncrl.config import load_config
from asyncrl.config.loader import ConfigError
from asyncrl.config.task_weights import TaskWeightsConfig
from asyncrl.data import PromptMixture, load_prompt_file, write_rows
from learner.services.task_weight_scheduler import TaskNameError, TaskWeightScheduler, file_tasks

SETTINGS = TaskWeightsConfig(enabled=True, metric="critic/{task}/score/mean", patience=2, min_delta=0.05, factor=0.5,
                             min_weight=0.1)


def step_metrics(a: float | None, b: float | None) -> dict[str, float]:
    values = {"critic/a/score/mean": a, "critic/b/score/mean": b, "critic/score/mean": 0.0}
    return {key: value for key, value in values.items() if value is not None}


def run(scheduler: TaskWeightScheduler, steps: dict[int, tuple[float | None, float | None]]) -> dict[int, list[float]]:
    weights = {}
    for step, (a, b) in steps.items():
        logged = scheduler.observe(step, step_metrics(a, b))
        weights[step] = [round(logged["tasks/a/weight"], 6), round(logged["tasks/b/weight"], 6)]
        assert weights[step] == [round(w, 6) for w in scheduler.weights]
    return weights


def test_a_saturated_task_gives_its_share_to_the_improving_one_down_to_the_floor():
    scheduler = TaskWeightScheduler(["a", "b"], [1.0, 1.0], SETTINGS)
    # a stays at 1.0 from step 1; b gains 0.1 a step (> min_delta: a new best every step)
    weights = run(scheduler, {step: (1.0, 0.1 * step) for step in range(1, 10)})
    assert weights[1] == weights[2] == [0.5, 0.5]
    assert weights[3] == [0.25, 0.75]  # a: no new best for 2 steps → 0.5 × 0.5; b gets the 0.25
    assert weights[4] == [0.25, 0.75]  # a was cut at step 3: not again before step 5
    assert weights[5] == [0.125, 0.875]
    assert weights[7] == [0.1, 0.9]  # 0.0625 would be under the floor
    assert weights[9] == [0.1, 0.9]


def test_gains_within_min_delta_are_no_improvement():
    scheduler = TaskWeightScheduler(["a", "b"], [], SETTINGS)
    # a creeps up by 0.01 (< min_delta 0.05) a step: stalled at step 3 all the same
    weights = run(scheduler, {1: (0.5, 0.1), 2: (0.51, 0.2), 3: (0.52, 0.3)})
    assert weights[3] == [0.25, 0.75]


def test_nothing_moves_when_every_task_stalls_or_none_was_measured():
    scheduler = TaskWeightScheduler(["a", "b"], [3.0, 1.0], SETTINGS)
    weights = run(scheduler, {1: (None, None), 2: (0.4, 0.4), 3: (0.4, 0.4), 4: (0.4, 0.4), 5: (0.4, 0.4)})
    assert set(map(tuple, weights.values())) == {(0.75, 0.25)}


def test_an_unmeasured_task_neither_gives_nor_takes():
    scheduler = TaskWeightScheduler(["a", "b", "c"], [1.0, 1.0, 2.0], SETTINGS)  # shares 0.25, 0.25, 0.5
    for step in range(1, 4):
        scheduler.observe(step, {"critic/a/score/mean": 1.0, "critic/b/score/mean": 0.1 * step})
    assert scheduler.weights == pytest.approx([0.125, 0.375, 0.5])  # c (never in a batch) kept its share


def test_the_state_resumes_the_same_schedule():
    steps = {step: (1.0, 0.1 * step) for step in range(1, 10)}
    straight = run(TaskWeightScheduler(["a", "b"], [], SETTINGS), steps)
    first = TaskWeightScheduler(["a", "b"], [], SETTINGS)
    run(first, {step: steps[step] for step in range(1, 5)})
    resumed = TaskWeightScheduler(["a", "b"], [], SETTINGS)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through the checkpoint's meta.json
    assert run(resumed, {step: steps[step] for step in range(5, 10)}) == {s: straight[s] for s in range(5, 10)}
    with pytest.raises(ValueError, match=r"saved for tasks \['a', 'b'\], not \['a', 'c'\]"):
        TaskWeightScheduler(["a", "c"], [], SETTINGS).load_state_dict(first.state_dict())


def test_the_watched_metric_may_be_any_logged_one():
    settings = TaskWeightsConfig(enabled=True, metric="val/{task}/acc/mean", patience=1, min_delta=0.0, factor=0.5,
                                 min_weight=0.0)
    scheduler = TaskWeightScheduler(["a", "b"], [], settings)
    scheduler.observe(1, {"val/a/acc/mean": 0.9, "val/b/acc/mean": 0.1, "critic/a/score/mean": 5.0})
    scheduler.observe(2, {"val/a/acc/mean": 0.9, "val/b/acc/mean": 0.2})
    assert scheduler.weights == pytest.approx([0.25, 0.75])


def rows(data_source: str, count: int = 3) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{i}+0="}], "data_source": data_source,
             "reward_model": {"ground_truth": str(i), "style": "rule"}} for i in range(count)]


def test_each_file_is_named_by_its_one_data_source(tmp_path):
    a, b = write_rows(rows("a"), tmp_path / "a.jsonl"), write_rows(rows("b"), tmp_path / "b.jsonl")
    mixed = write_rows(rows("a") + rows("c"), tmp_path / "mixed.jsonl")
    load = lambda *paths: ([str(p) for p in paths], [load_prompt_file(p) for p in paths])  # noqa: E731
    assert file_tasks(*load(a, b)) == ["a", "b"]
    with pytest.raises(TaskNameError, match=r"one data_source per training file; '.*mixed.jsonl' holds \['a', 'c'\]"):
        file_tasks(*load(a, mixed))
    with pytest.raises(TaskNameError, match=r"'.*a2.jsonl' and '.*a.jsonl' both hold data_source 'a'"):
        file_tasks(*load(a, write_rows(rows("a"), tmp_path / "a2.jsonl")))


def test_the_mixture_draws_with_new_weights_and_keeps_them_in_its_state(tmp_path):
    files = [str(write_rows(rows(name, 10), tmp_path / f"{name}.jsonl")) for name in "ab"]
    mixture = PromptMixture(files, [0.5, 0.5], seed=3)
    mixture.set_weights([0.1, 0.9])
    counts = Counter(next(mixture).data_source for _ in range(4000))
    assert 0.08 < counts["a"] / 4000 < 0.12  # expected 0.1; binomial sd ≈ 0.005
    state = json.loads(json.dumps(mixture.state_dict()))
    expected = [next(mixture).messages for _ in range(50)]
    resumed = PromptMixture(files, [0.5, 0.5], seed=3)
    resumed.load_state_dict(state)
    assert resumed.weights == [0.1, 0.9] and [next(resumed).messages for _ in range(50)] == expected
    with pytest.raises(ValueError, match="need 2 non-negative weights"):
        mixture.set_weights([1.0])


# Valid task weights, which each case below spoils with its overrides.
TWO_WEIGHTED_TASKS = ["data.task_weights.enabled=true", "data.train_files=[a.jsonl,b.jsonl]"]


@pytest.mark.parametrize(("overrides", "problem"), [
    (["data.task_weights.metric=critic/score/mean"], r"data.task_weights.metric: must contain \{task\}"),
    (["data.task_weights.min_weight=0.6"], r"data.task_weights.min_weight: 2 tasks cannot each keep 0.6"),
    (["data.train_files=[a.jsonl]"], r"data.task_weights.enabled: needs at least two data.train_files"),
    (["learner.mode=synchronous"], r"data.task_weights.enabled: the synchronous reference"),
    (["data.weights=[39,1]"], r"data.task_weights.min_weight: data.weights start a task at a share of 0.025, below the floor 0.05"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, [*TWO_WEIGHTED_TASKS, *overrides])


def test_a_task_just_cut_does_not_take_share_back_without_a_new_best():
    # a saturates at once; b improves until step 4, then stalls too: a is cut at steps 3 and 5 (b's last best is
    # within patience), b is stalled from step 6 on, and a, in cool-down or stalled, is never "improving": nothing
    # flows back to it
    scheduler = TaskWeightScheduler(["a", "b"], [], SETTINGS)
    weights = run(scheduler, {step: (1.0, min(step, 4) * 0.1) for step in range(1, 12)})
    assert weights[3] == weights[4] == [0.25, 0.75]
    assert all(weights[step] == [0.125, 0.875] for step in range(5, 12))
    assert scheduler.metrics(11)["tasks/b/steps_since_best"] == 7.0
