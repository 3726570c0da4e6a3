"""Data files: verl layout in parquet and JSONL, errors naming file/row/field, weighted mixing, resume."""

import json
from collections import Counter

import pytest

from launch.commands.data import write_task_files
from asyncrl.config.sections import TaskConfig
from asyncrl.data import DataError, PromptMixture, load_prompt_file, write_rows
from demo.tasks import arithmetic
from rollout_servers.rewards.builtin import exact_match


def verl_row(question="1+2=", answer="3", source="arithmetic"):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": 0},
    }


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_round_trip_of_verl_rows(tmp_path, suffix):
    path = write_rows([verl_row("1+2=", "3"), verl_row("4*5=", "20", "other")], tmp_path / f"f.{suffix}")
    rows = load_prompt_file(path)
    assert [r.messages for r in rows] == [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "4*5="}]]
    assert [(r.data_source, r.ground_truth, r.row_index) for r in rows] == [("arithmetic", "3", 0), ("other", "20", 1)]
    assert rows[0].extra_info == {"index": 0} and rows[0].ability == "math"


def test_numeric_and_list_ground_truths_become_text(tmp_path):
    row = verl_row()
    row["reward_model"]["ground_truth"] = 42
    other = verl_row()
    other["reward_model"]["ground_truth"] = ["a", "b"]
    rows = load_prompt_file(write_rows([row, other], tmp_path / "f.jsonl"))
    assert [r.ground_truth for r in rows] == ["42", '["a", "b"]']


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r.pop("reward_model"), "reward_model"),
        (lambda r: r.update(data_source=""), "data_source"),
        (lambda r: r.update(prompt=[]), "prompt"),
        (lambda r: r.update(prompt=[{"role": "robot", "content": "x"}]), "prompt[0].role"),
        (lambda r: r.update(prompt=[{"role": "user", "content": 5}]), "prompt[0].content"),
        (lambda r: r.update(extra_info="x"), "extra_info"),
        (lambda r: r.update(extra_info={"max_tokens": 0}), "extra_info.max_tokens"),
        (lambda r: r.update(extra_info={"max_tokens": "64"}), "extra_info.max_tokens"),
    ],
)
def test_malformed_row_error_names_file_row_and_field(tmp_path, mutate, field):
    bad = verl_row()
    mutate(bad)
    path = write_rows([verl_row(), verl_row(), bad], tmp_path / "f.jsonl")
    with pytest.raises(DataError) as error:
        load_prompt_file(path)
    assert str(path) in str(error.value) and "row 2" in str(error.value) and field in str(error.value)


def test_broken_json_line_is_reported_or_skipped(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text(json.dumps(verl_row()) + "\n{not json\n\n" + json.dumps(verl_row("2+2=", "4")) + "\n")
    with pytest.raises(DataError, match="row 1: not valid JSON"):
        load_prompt_file(path)
    rows = load_prompt_file(path, skip_bad_rows=True)
    assert [r.ground_truth for r in rows] == ["3", "4"]


def test_missing_unreadable_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_prompt_file(tmp_path / "absent.parquet")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"definitely not parquet")
    with pytest.raises(DataError, match="corrupt.parquet"):
        load_prompt_file(corrupt)
    (tmp_path / "f.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported suffix"):
        load_prompt_file(tmp_path / "f.csv")


def test_mixture_follows_weights_and_resumes_exactly(tmp_path):
    a = write_rows([verl_row(f"{i}+0=", str(i), "a") for i in range(10)], tmp_path / "a.jsonl")
    b = write_rows([verl_row(f"{i}+1=", str(i + 1), "b") for i in range(10)], tmp_path / "b.parquet")
    mixture = PromptMixture([str(a), str(b)], weights=[3, 1], seed=5)
    counts = Counter(next(mixture).data_source for _ in range(4000))
    assert 0.72 < counts["a"] / 4000 < 0.78  # expected 0.75; binomial sd ≈ 0.007
    state = mixture.state_dict()
    expected = [next(mixture).messages for _ in range(50)]
    resumed = PromptMixture([str(a), str(b)], weights=[3, 1], seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state survives JSON (checkpoint metadata)
    assert [next(resumed).messages for _ in range(50)] == expected


def test_mixture_visits_every_row_once_per_epoch(tmp_path):
    path = write_rows([verl_row(f"{i}+0=", str(i)) for i in range(7)], tmp_path / "a.jsonl")
    mixture = PromptMixture([str(path)], seed=1)
    first, second = [[next(mixture).row_index for _ in range(7)] for _ in range(2)]
    assert sorted(first) == sorted(second) == list(range(7))
    assert first != second  # a new order each epoch


def test_task_files_are_deterministic_and_disjoint(tmp_path):
    task = TaskConfig(out_dir=str(tmp_path / "x"), num_train=300, num_val=40, max_digits=2)
    paths = write_task_files(task, seed=3)
    train, val = load_prompt_file(paths["train"]), load_prompt_file(paths["val"])
    assert len(train) == 300 and len(val) == 40
    val_questions = {r.messages[0]["content"] for r in val}
    assert len(val_questions) == 40 and not val_questions & {r.messages[0]["content"] for r in train}
    for row in train[:50]:
        question = row.messages[0]["content"]
        assert exact_match(str(eval(question[:-1])), row.ground_truth) == 1.0
    again = write_task_files(TaskConfig(**{**task.__dict__, "out_dir": str(tmp_path / "y")}), seed=3)
    assert again["train"].read_bytes() == paths["train"].read_bytes()


def test_difficulty_knob_sets_operand_digits():
    import random

    rng = random.Random(0)
    for _ in range(200):
        question, _ = arithmetic.make_problem(rng, 3, 4, "+")
        left, right = question[:-1].split("+")
        assert 3 <= len(left) <= 4 and 3 <= len(right) <= 4
