"""Built-in `guess_number` environment: the model guesses a hidden integer and hears "higher" or "lower"
after each wrong guess. Two reward rules, chosen per row by `extra_info.reward`:

- `fewer_guesses` (the default): 1 − (guesses − 1) / max_guesses on success, 0 when the guesses run out;
- `solved`: 1 on success within max_guesses, else 0. With max_guesses = ⌈log2(max_number + 1)⌉ only
  bisection always wins, and a lucky early hit earns no more than a methodical one, so the reward tracks
  the skill instead of the luck of the draw.

Two kinds of feedback, chosen per row by `extra_info.feedback`:

- `direction` (the default): "higher", "lower" or "invalid";
- `range`: the same word plus the numbers still possible, "higher: 17-31" (1..`extra_info.max_number` at
  first, narrowed by every answer so far). Bisection needs the range left; with `direction` the policy
  must rebuild it from every earlier turn, which a tiny model does poorly: its guesses stray outside the
  range. With `range` the last message holds the whole state, and the task left is to pick its middle.

A row's `reward_model.ground_truth` is the hidden number; `extra_info.max_guesses` caps the guesses. The row keys,
their values and the feedback are shared with the demo's task that writes the rows:
`asyncrl.environments.guess_number_game`.
"""

from __future__ import annotations

from asyncrl.data import PromptRow
from asyncrl.environments.base import Environment, Message, ModelTurn, StepResult
from asyncrl.environments.guess_number_game import (
    DIRECTION,
    FEEDBACK_KEY,
    FEEDBACK_STYLES,
    FEWER_GUESSES,
    MAX_GUESSES_KEY,
    MAX_NUMBER_KEY,
    RANGE,
    REWARD_KEY,
    REWARD_RULES,
    SOLVED,
    feedback,
    narrow,
    observation_text,
)

DEFAULT_MAX_GUESSES = 6  # when the row does not say


def solved_reward(guesses: int, max_guesses: int, rule: str = FEWER_GUESSES) -> float:
    """Reward of finding the number with the `guesses`-th guess."""
    if rule == SOLVED:
        return 1.0
    return 1.0 - (guesses - 1) / max_guesses


def row_choice(extra_info: dict, key: str, choices: tuple[str, ...]) -> str:
    """The row's setting `key` (default: the first choice); an unknown value is a malformed row (the
    episode fails as env_error)."""
    value = str(extra_info.get(key, choices[0]))
    if value not in choices:
        raise ValueError(f"guess_number: extra_info.{key} '{value}' is not one of {list(choices)}")
    return value


def max_number(extra_info: dict, style: str) -> int:
    """The top of the first range; range feedback cannot do without it."""
    if style == RANGE and MAX_NUMBER_KEY not in extra_info:
        raise ValueError(f"guess_number: range feedback needs extra_info.{MAX_NUMBER_KEY}")
    return int(extra_info.get(MAX_NUMBER_KEY, 0))


class GuessNumberEnvironment(Environment):
    def __init__(self) -> None:
        self._target = 0
        self._max_guesses = DEFAULT_MAX_GUESSES
        self._guesses = 0
        self._rule = FEWER_GUESSES
        self._style = DIRECTION
        self._low, self._high = 1, 0  # the numbers still possible

    async def reset(self, sample: PromptRow) -> list[Message]:
        self._target = int(sample.ground_truth)
        self._max_guesses = int(sample.extra_info.get(MAX_GUESSES_KEY, DEFAULT_MAX_GUESSES))
        self._rule = row_choice(sample.extra_info, REWARD_KEY, REWARD_RULES)
        self._style = row_choice(sample.extra_info, FEEDBACK_KEY, FEEDBACK_STYLES)
        self._low, self._high = 1, max_number(sample.extra_info, self._style)
        self._guesses = 0
        return list(sample.messages)

    async def step(self, turn: ModelTurn) -> StepResult:
        self._guesses += 1
        text = turn.text.strip()
        guess = int(text) if text.isdigit() else None
        info = {"guesses": float(self._guesses)}
        if guess == self._target:
            return StepResult(reward=solved_reward(self._guesses, self._max_guesses, self._rule), done=True, info=info | {"solved": 1.0})
        if self._guesses >= self._max_guesses:
            return StepResult(done=True, info=info | {"solved": 0.0})
        answer = feedback(guess, self._target)
        self._low, self._high = narrow(self._low, self._high, guess, answer)
        message = {"role": "user", "content": observation_text(answer, self._low, self._high, self._style)}
        return StepResult(observation=[message], info=info)
