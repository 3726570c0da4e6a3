"""The task split: held-out questions are decided once, and neither the training file nor the warm
start ever uses them."""

import asyncio
import random

from launch.commands.data import write_task_files
from asyncrl.config.sections import GuessNumberTaskConfig, TaskConfig, WarmStartConfig
from asyncrl.data import PromptRow, load_prompt_file
from asyncrl.environments import ModelTurn
from rollout_servers.environments.guess_number import GuessNumberEnvironment
from asyncrl.environments.calculator_tool import CALCULATOR_TOOL
from rollout_servers.environments.calculator import CalculatorEnvironment
from demo.tasks import calculator, guess_number
from demo.tasks.arithmetic import noisy_answer
from demo.tasks.splits import split_task
from demo.tiny import warm_start as warm_start_module
from demo.tiny.model import build_tiny_model
from demo.tiny.tokenizer import build_char_tokenizer
from asyncrl.config import load_config

SINGLE_DIGIT_SUMS = 100  # distinct questions of one-digit addition: a space small enough to exhaust


def test_split_is_deterministic_distinct_and_disjoint():
    task = TaskConfig(num_train=500, num_val=30, min_digits=2, max_digits=2, operators="+")
    split = split_task(task, seed=5)
    assert split == split_task(task, seed=5) and split != split_task(task, seed=6)
    assert len(split.val) == len(split.val_questions) == 30
    assert len(split.train) == 500 and not split.val_questions & {q for q, _ in split.train}


def test_val_file_holds_exactly_the_split_val_questions(tmp_path):
    task = TaskConfig(out_dir=str(tmp_path), num_train=50, num_val=20, max_digits=2)
    val_rows = load_prompt_file(write_task_files(task, seed=1)["val"])
    assert {row.messages[0]["content"] for row in val_rows} == split_task(task, seed=1).val_questions


def test_warm_start_never_trains_on_a_held_out_question(monkeypatch):
    task = TaskConfig(num_train=10, num_val=SINGLE_DIGIT_SUMS // 2, min_digits=1, max_digits=1, operators="+")
    held_out = split_task(task, seed=0).val_questions
    seen: list[str] = []
    real_example = warm_start_module.supervised_example

    def recording_example(tokenizer, question, answer, thinking):
        seen.append(question)
        return real_example(tokenizer, question, answer, thinking)

    monkeypatch.setattr(warm_start_module, "supervised_example", recording_example)
    shape = load_config(None, ["model.tiny.hidden_size=32", "model.tiny.num_layers=1"]).model.tiny
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(shape, tokenizer, seed=0)
    schedule = WarmStartConfig(steps=4, batch_size=32, warmup_steps=1)
    warm_start_module.warm_start(model, tokenizer, task, schedule, seed=0, held_out=held_out)
    assert len(seen) == 4 * 32
    assert not set(seen) & held_out
    assert len(set(seen)) > SINGLE_DIGIT_SUMS // 4  # a real spread of the remaining questions


def test_split_gives_fewer_val_problems_when_the_space_runs_out():
    task = TaskConfig(num_train=10, num_val=SINGLE_DIGIT_SUMS + 50, min_digits=1, max_digits=1, operators="+")
    split = split_task(task, seed=0)
    assert len(split.val) == SINGLE_DIGIT_SUMS and len(split.val_questions) == len(split.val)


def test_label_noise_replaces_digits_at_the_configured_rate():
    rng = random.Random(0)
    assert noisy_answer("-123", 0.0, rng) == "-123"
    noisy = [noisy_answer("1234567890", 0.3, rng) for _ in range(2000)]
    assert all(len(answer) == 10 and answer.isdigit() for answer in noisy)
    changed = sum(a != b for answer in noisy for a, b in zip(answer, "1234567890")) / (2000 * 10)
    assert abs(changed - 0.3 * 0.9) < 0.01  # a replacement draws the same digit one time in ten
    assert noisy_answer("-7", 1.0, random.Random(1))[0] == "-"  # the sign is never noise


def test_guess_number_rows_carry_the_game_settings_for_the_environment(tmp_path):
    settings = GuessNumberTaskConfig(max_number=31, max_guesses=5, reward="solved", feedback="range")
    task = TaskConfig(name="guess_number", out_dir=str(tmp_path), num_train=5, num_val=3, guess_number=settings)
    rows = load_prompt_file(write_task_files(task, seed=0)["val"])
    assert len(rows) == 3 and all(1 <= int(row.ground_truth) <= 31 for row in rows)
    seen = {tuple(row.extra_info[key] for key in ("max_number", "max_guesses", "reward", "feedback")) for row in rows}
    assert seen == {(31, 5, "solved", "range")}


def test_guess_number_teacher_bisects_and_hears_what_the_environment_says():
    settings = GuessNumberTaskConfig(max_number=31, max_guesses=5, bisect_rate=1.0, feedback="range")
    task = TaskConfig(name="guess_number", guess_number=settings)
    dialogue = guess_number.teacher_dialogue(random.Random(3), task, 0.0, frozenset())
    guesses = [text for text, _ in dialogue.turns]
    assert guesses[0] == "16"  # the middle of 1..31; bisection then always finds the number, the last guess
    extra_info = guess_number.make_row(("", "0"), 0, "train", task)["extra_info"]
    row = PromptRow(dialogue.messages, "guess_number", guesses[-1], extra_info=extra_info)
    environment = GuessNumberEnvironment()
    asyncio.run(environment.reset(row))
    heard = [asyncio.run(environment.step(ModelTurn(text, [], "stop", i))).observation for i, text in enumerate(guesses)]
    assert heard == [observation for _, observation in dialogue.turns]


def test_function_calling_teacher_writes_the_call_the_template_renders_and_the_environment_answers(tmp_path):
    task = TaskConfig(name="calculator", out_dir=str(tmp_path), num_train=5, num_val=3, min_digits=2, max_digits=2,
                      operators="*")
    task.calculator.tool_format, task.calculator.tool_use_rate = "hermes", 1.0
    assert {row.extra_info["tool_format"] for row in load_prompt_file(write_task_files(task, seed=0)["val"])} == {"hermes"}
    dialogue = calculator.teacher_dialogue(random.Random(2), task, 0.0, frozenset())
    (call, observation), (answer, _) = dialogue.turns
    question = dialogue.messages[0]["content"]
    assert dialogue.tools == [CALCULATOR_TOOL]
    assert call == '<tool_call>{"name": "calc", "arguments": {"expr": "%s"}}</tool_call>' % question.rstrip("=")
    # the teacher's text is what the template renders for an assistant message holding that call (the parsed view)
    message = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "calc", "arguments": '{"expr": "%s"}' % question.rstrip("=")}}]}
    rendered = build_char_tokenizer().apply_chat_template([message], tokenize=False)
    assert rendered == f"<|im_start|>assistant\n{call}<|im_end|>\n"
    environment = CalculatorEnvironment()
    asyncio.run(environment.reset(PromptRow(dialogue.messages, "calculator", answer, extra_info={"tool_format": "hermes"})))
    heard = asyncio.run(environment.step(ModelTurn(call, [], "stop", 0, message["tool_calls"]))).observation
    assert heard == observation == [{"role": "tool", "tool_call_id": "call_0", "content": answer}]
