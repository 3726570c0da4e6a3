"""The `guess_number` task: find a hidden number in 1..max_number from "higher"/"lower" feedback
(`asyncrl.environments.guess_number_game`); fewer guesses earn more.

The warm-start teacher always guesses inside the range still possible, at its middle in
`task.guess_number.bisect_rate` of its guesses and anywhere in it otherwise: the model learns the
format and consistent play, RL learns to bisect.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.config.sections import TaskConfig
from asyncrl.environments.guess_number_game import (
    FEEDBACK_KEY,
    MAX_GUESSES_KEY,
    MAX_NUMBER_KEY,
    REWARD_KEY,
    feedback,
    narrow,
    observation_text,
)
from demo.tasks.dialogue import Dialogue
from demo.tasks.splits import Problem, TaskSplit

DATA_SOURCE = "guess_number"


def question(max_number: int) -> str:
    return f"Guess my number, 1 to {max_number}."


def split(task: TaskConfig, seed: int) -> TaskSplit:
    """Hidden numbers drawn uniformly; nothing is held out (the number never appears in the prompt)."""
    rng = random.Random(seed)
    settings = task.guess_number

    def draw(count: int) -> list[Problem]:
        return [(question(settings.max_number), str(rng.randint(1, settings.max_number))) for _ in range(count)]

    return TaskSplit(val=draw(task.num_val), train=draw(task.num_train))


def make_row(problem: Problem, index: int, split_name: str, task: TaskConfig) -> dict[str, Any]:
    prompt, target = problem
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "game",
        "reward_model": {"style": "rule", "ground_truth": target},
        "extra_info": {
            "index": index,
            "split": split_name,
            MAX_GUESSES_KEY: task.guess_number.max_guesses,
            MAX_NUMBER_KEY: task.guess_number.max_number,
            REWARD_KEY: task.guess_number.reward,
            FEEDBACK_KEY: task.guess_number.feedback,
        },
    }


def teacher_dialogue(rng: random.Random, task: TaskConfig, label_noise: float, held_out: frozenset[str]) -> Dialogue:
    """One teacher game on a fresh hidden number, up to `max_guesses` guesses."""
    settings = task.guess_number
    target, low, high = rng.randint(1, settings.max_number), 1, settings.max_number
    turns = []
    for number in range(1, settings.max_guesses + 1):
        guess = (low + high) // 2 if rng.random() < settings.bisect_rate else rng.randint(low, high)
        if guess == target or number == settings.max_guesses:  # solved, or out of guesses: the game ends
            turns.append((str(guess), []))
            break
        answer = feedback(guess, target)
        low, high = narrow(low, high, guess, answer)
        turns.append((str(guess), [{"role": "user", "content": observation_text(answer, low, high, settings.feedback)}]))
    return Dialogue([{"role": "user", "content": question(settings.max_number)}], turns)
