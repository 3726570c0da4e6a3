"""The `guess_number` game as both sides of a row see it: the `extra_info` keys a row sets and the values they
take, and the game's feedback to a wrong guess. The built-in environment (`rollout_servers.environments.guess_number`)
plays the game with them; the demo's task (`demo.tasks.guess_number`) writes rows and its teacher's games.
"""

from __future__ import annotations

MAX_GUESSES_KEY = "max_guesses"  # extra_info field: guesses allowed in the episode
REWARD_KEY = "reward"  # extra_info field: the reward rule, one of REWARD_RULES
FEWER_GUESSES, SOLVED = "fewer_guesses", "solved"
REWARD_RULES = (FEWER_GUESSES, SOLVED)  # the first is the default: rows written before the rule existed
FEEDBACK_KEY = "feedback"  # extra_info field: the kind of feedback, one of FEEDBACK_STYLES
DIRECTION, RANGE = "direction", "range"
FEEDBACK_STYLES = (DIRECTION, RANGE)  # the first is the default, as for REWARD_RULES
MAX_NUMBER_KEY = "max_number"  # extra_info field: the largest possible number (needed by range feedback)
HIGHER, LOWER, INVALID = "higher", "lower", "invalid"  # feedback: the number is higher / lower / not a number


def feedback(guess: int | None, target: int) -> str:
    """What the game answers to a wrong or unreadable guess."""
    if guess is None:
        return INVALID
    return HIGHER if target > guess else LOWER


def narrow(low: int, high: int, guess: int | None, answer: str) -> tuple[int, int]:
    """The numbers still possible after `answer` to `guess`; a guess outside the range narrows nothing."""
    if answer == HIGHER:
        return max(low, guess + 1), high
    if answer == LOWER:
        return low, min(high, guess - 1)
    return low, high


def observation_text(answer: str, low: int, high: int, style: str) -> str:
    """The user message after a wrong guess: the answer, and with `range` feedback what is still possible."""
    return f"{answer}: {low}-{high}" if style == RANGE else answer
