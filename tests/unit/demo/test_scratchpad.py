"""The scratchpad task: its worked solutions, the long tail of its sizes, its split, the lengths the config checks
against the model's limits, and the warm start's teacher."""

import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.config.sections import ScratchpadTaskConfig, TaskConfig, WarmStartConfig
from asyncrl.data import load_prompt_file
from demo.tasks import scratchpad
from demo.tiny import warm_start as warm_start_module
from demo.tiny.model import build_tiny_model
from demo.tiny.tokenizer import build_char_tokenizer
from launch.commands.data import write_task_files
from rollout_servers.rewards.builtin import compute_score

SOLUTION_367_398 = "367+398:7+8+0=15:5\n36+39:6+9+1=16:65\n3+3:3+3+1=07:765\n=765"
DRAWS = 30_000


def test_the_teacher_works_each_column_and_ends_with_the_scored_answer():
    assert scratchpad.worked_solution(("367+398=", "765"), 0.0, random.Random(0)) == SOLUTION_367_398
    assert scratchpad.worked_solution(("5+7=", "12"), 0.0, random.Random(0)) == "5+7:5+7+0=12:2\n=12"
    assert scratchpad.worked_solution(("0+0=", "0"), 0.0, random.Random(0)) == "0+0:0+0+0=00:0\n=0"
    assert compute_score("scratchpad", SOLUTION_367_398, "765") == 1.0
    rng = random.Random(4)
    for _ in range(200):
        size = rng.randint(1, 12)
        question, answer = scratchpad.problems(ScratchpadTaskConfig(min_size=size, max_size=size), 0.0)(rng)
        assert compute_score("scratchpad", scratchpad.worked_solution((question, answer), 0.0, rng), answer) == 1.0


def test_a_slip_changes_one_sum_digit_and_the_answer_carries_it():
    rng = random.Random(1)
    question, answer = "99999999+99999999=", "199999998"
    slipped = wrong = lines = 0
    for _ in range(500):
        solution = scratchpad.worked_solution((question, answer), 0.3, rng)
        *worked, final = solution.splitlines()
        digits = [line.split(":")[1][-1] for line in worked]  # the sum digit each column wrote
        assert [line.split(":")[1][:-1] for line in worked] == ["9+9+0=1"] + ["9+9+1=1"] * 7  # carries stay right
        assert final == "=1" + "".join(reversed(digits))  # the answer is what the columns wrote
        lines += len(digits)
        slipped += sum(digit != right for digit, right in zip(digits, "89999999"))
        wrong += final != "=" + answer
    assert abs(slipped / lines - 0.3 * 0.9) < 0.02  # a random digit is the right one a time in ten
    assert abs(wrong / 500 - (1 - (1 - 0.27) ** 8)) < 0.05  # any slip makes the answer wrong


@pytest.mark.parametrize(("tail", "expected"), [(1.0, [6 / 11, 3 / 11, 2 / 11]), (0.0, [1 / 3] * 3),
                                                (2.0, [36 / 49, 9 / 49, 4 / 49])])
def test_sizes_are_drawn_with_probability_proportional_to_size_to_the_minus_tail(tail, expected):
    make, rng = scratchpad.problems(ScratchpadTaskConfig(min_size=1, max_size=3), tail), random.Random(2)
    counts = Counter(len(make(rng)[0].split("+")[0]) for _ in range(DRAWS))
    assert [counts[size] / DRAWS for size in (1, 2, 3)] == pytest.approx(expected, abs=0.01)


def test_held_out_sizes_follow_val_tail_and_training_never_holds_a_held_out_question(tmp_path):
    settings = ScratchpadTaskConfig(min_size=2, max_size=4, tail=2.0, val_tail=0.0)
    task = TaskConfig(name="scratchpad", out_dir=str(tmp_path), num_train=4000, num_val=400, scratchpad=settings)
    files = write_task_files(task, seed=0)
    val, train = load_prompt_file(files["val"]), load_prompt_file(files["train"])
    assert {row.data_source for row in val + train} == {"scratchpad"}

    def share_of_size(rows, size):
        return sum(len(row.messages[0]["content"].split("+")[0]) == size for row in rows) / len(rows)

    # held out: each size a third; training: ∝ size^-2, i.e. size 4 (1/16) / (1/4 + 1/9 + 1/16)
    assert [share_of_size(val, size) for size in (2, 3, 4)] == pytest.approx([1 / 3] * 3, abs=0.06)
    assert share_of_size(train, 4) == pytest.approx((1 / 16) / (1 / 4 + 1 / 9 + 1 / 16), abs=0.015)
    assert not {row.messages[0]["content"] for row in val} & {row.messages[0]["content"] for row in train}


@pytest.mark.parametrize("size", [1, 2, 7, 21, 30])
def test_the_config_counts_the_longest_prompt_and_solution_as_the_tokenizer_does(size):
    tokenizer, settings = build_char_tokenizer(), ScratchpadTaskConfig(max_size=size)
    question = "9" * size + "+" + "9" * size + "="  # every column carries: the longest solution
    solution = scratchpad.worked_solution((question, ""), 0.0, random.Random(0))
    assert len(warm_start_module.prompt_ids(tokenizer, question)) == settings.longest_prompt_tokens()
    assert len(tokenizer.encode(solution, add_special_tokens=False)) + 1 == settings.longest_response_tokens()


def test_a_largest_problem_that_does_not_fit_is_refused_naming_each_limit():
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["task.name=scratchpad", "task.scratchpad.max_size=21", "rollout.sampling.max_tokens=1000",
                           "data.max_prompt_length=62"])
    message = str(refused.value)
    assert "rollout.engine.max_model_len: is 256, but the largest scratchpad problem (task.scratchpad.max_size=21) " \
           "needs 1032 tokens for its prompt + solution" in message  # 63 prompt + 969 solution tokens
    assert "model.tiny.max_position: is 256" in message and "data.max_prompt_length: is 62" in message
    assert "rollout.sampling.max_tokens" not in message
    fits = ["task.name=scratchpad", "task.scratchpad.max_size=21", "rollout.sampling.max_tokens=969",
            "rollout.engine.max_model_len=1032", "model.tiny.max_position=1032"]
    assert load_config(None, fits).task.scratchpad.max_size == 21
    assert load_config(None, ["task.scratchpad.max_size=21"]).task.name == "arithmetic"  # other tasks: no check
    with pytest.raises(ConfigError, match="task.scratchpad.min_size: must not exceed task.scratchpad.max_size=3"):
        load_config(None, ["task.name=scratchpad", "task.scratchpad.min_size=4", "task.scratchpad.max_size=3"])


def test_the_warm_start_learns_noisy_worked_solutions_of_training_questions(monkeypatch):
    task = TaskConfig(name="scratchpad", scratchpad=ScratchpadTaskConfig(min_size=1, max_size=3))
    held_out = frozenset({"1+2=", "3+4="})
    shown: list[tuple[str, str]] = []
    real_example = warm_start_module.supervised_example

    def recording_example(tokenizer, question, response, thinking):
        shown.append((question, response))
        return real_example(tokenizer, question, response, thinking)

    monkeypatch.setattr(warm_start_module, "supervised_example", recording_example)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(load_config(None, ["model.tiny.hidden_size=32", "model.tiny.num_layers=1"]).model.tiny,
                             tokenizer, seed=0)
    schedule = WarmStartConfig(steps=2, batch_size=64, warmup_steps=1, label_noise=0.5)
    warm_start_module.warm_start(model, tokenizer, task, schedule, seed=0, held_out=held_out)
    assert len(shown) == 2 * 64 and not {question for question, _ in shown} & held_out
    right = [response == scratchpad.worked_solution((question, ""), 0.0, random.Random(0)) for question, response in shown]
    assert 0 < sum(right) < len(right)  # the teacher slips at label_noise per column, and not always


def test_the_gpu_preset_loads_with_a_tens_of_millions_parameter_model_and_long_responses():
    config = load_config(Path(__file__).resolve().parents[3] / "configs" / "gpu_longtail.yaml")
    settings = config.task.scratchpad
    assert config.task.name == "scratchpad" and (settings.min_size, settings.max_size) == (1, 21)
    assert settings.longest_response_tokens() == 969 <= config.rollout.sampling.max_tokens
    assert settings.longest_prompt_tokens() + 969 <= config.rollout.engine.max_model_len
    with torch.device("meta"):  # the shape only: no memory, no initialisation
        model = build_tiny_model(config.model.tiny, build_char_tokenizer(), seed=0)
    assert 50e6 < sum(p.numel() for p in model.parameters()) < 200e6
    assert config.model.warm_start.device == config.learner.device == "cuda"
    assert config.validation.every and config.validation.length_buckets[-1] < 969  # the longest have a bucket
