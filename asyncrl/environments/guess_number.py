"""Built-in `guess_number` environment: the model guesses a hidden integer and hears "higher" or "lower"
after each wrong guess. Two reward rules, chosen per row by `extra_info.reward`:

- `fewer_guesses` (the default): 1 − (guesses − 1) / max_guesses on success, 0 when the guesses run out;
- `solved`: 1 on success within max_guesses, else 0. With max_guesses = ⌈log2(max_number + 1)⌉ only
  bisection always wins, and a lucky early hit earns no more than a methodical one, so the reward tracks
  the skill instead of the luck of the draw.

A row's `reward_model.ground_truth` is the hidden number; `extra_info.max_guesses` caps the guesses.
"""

from __future__ import annotations

from asyncrl.data import PromptRow
from asyncrl.environments.base import Environment, Message, ModelTurn, StepResult

MAX_GUESSES_KEY = "max_guesses"  # extra_info field: guesses allowed in the episode
DEFAULT_MAX_GUESSES = 6  # when the row does not say
REWARD_KEY = "reward"  # extra_info field: the reward rule, one of REWARD_RULES
FEWER_GUESSES, SOLVED = "fewer_guesses", "solved"
REWARD_RULES = (FEWER_GUESSES, SOLVED)  # the first is the default: rows written before the rule existed
HIGHER, LOWER, INVALID = "higher", "lower", "invalid"  # feedback: the number is higher / lower / not a number


def feedback(guess: int | None, target: int) -> str:
    """What the game answers to a wrong or unreadable guess."""
    if guess is None:
        return INVALID
    return HIGHER if target > guess else LOWER


def solved_reward(guesses: int, max_guesses: int, rule: str = FEWER_GUESSES) -> float:
    """Reward of finding the number with the `guesses`-th guess."""
    if rule == SOLVED:
        return 1.0
    return 1.0 - (guesses - 1) / max_guesses


def reward_rule(extra_info: dict) -> str:
    """The row's reward rule; an unknown one is a malformed row (the episode fails as env_error)."""
    rule = str(extra_info.get(REWARD_KEY, FEWER_GUESSES))
    if rule not in REWARD_RULES:
        raise ValueError(f"guess_number: extra_info.{REWARD_KEY} '{rule}' is not one of {list(REWARD_RULES)}")
    return rule


class GuessNumberEnvironment(Environment):
    def __init__(self) -> None:
        self._target = 0
        self._max_guesses = DEFAULT_MAX_GUESSES
        self._guesses = 0
        self._rule = FEWER_GUESSES

    async def reset(self, sample: PromptRow) -> list[Message]:
        self._target = int(sample.ground_truth)
        self._max_guesses = int(sample.extra_info.get(MAX_GUESSES_KEY, DEFAULT_MAX_GUESSES))
        self._rule = reward_rule(sample.extra_info)
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
        return StepResult(observation=[{"role": "user", "content": feedback(guess, self._target)}], info=info)
