"""Multi-digit arithmetic: "37+58=" → "95". Verifiable by exact match; difficulty set by digit counts."""

from __future__ import annotations

import random
import string
from typing import Any

from asyncrl.data.builtin_sources import EXACT_MATCH_SOURCE

DATA_SOURCE = EXACT_MATCH_SOURCE  # scored by the rollout servers' built-in exact match
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_problem(rng: random.Random, min_digits: int, max_digits: int, operators: str) -> tuple[str, str]:
    """One question ("37+58=") and its answer ("95")."""
    a = _operand(rng, min_digits, max_digits)
    b = _operand(rng, min_digits, max_digits)
    op = rng.choice(operators)
    return f"{a}{op}{b}=", str(_APPLY[op](a, b))


def make_row(question: str, answer: str, index: int, split: str) -> dict[str, Any]:
    """A row in verl's layout."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": index, "split": split},
    }


def noisy_answer(answer: str, noise: float, rng: random.Random) -> str:
    """`answer` with each digit replaced by a uniformly drawn digit with probability `noise`."""
    return "".join(rng.choice(string.digits) if c.isdigit() and rng.random() < noise else c for c in answer)


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)
