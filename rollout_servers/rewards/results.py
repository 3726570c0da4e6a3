"""What a scorer is asked and what it answers: requests in, results (or recorded failures) out."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

from asyncrl.user_code import describe_exception

__all__ = ["SCORE_KEY", "RewardRequest", "RewardResult", "describe_exception", "result_from_return"]

SCORE_KEY = "score"  # verl: a reward function may return a dict whose "score" entry is the reward


@dataclass
class RewardRequest:
    """One completion to score, with verl's reward-function arguments."""

    data_source: str  # dataset the prompt came from; picks the built-in scorer
    solution_str: str  # the decoded completion
    ground_truth: Any  # `reward_model.ground_truth` of the data row (usually a string)
    extra_info: dict[str, Any] | None = None  # `extra_info` of the data row, passed through untouched

    @classmethod
    def for_row(cls, row: Mapping[str, Any], solution_str: str) -> RewardRequest:
        """The request for a completion of a verl-layout data row."""
        return cls(row["data_source"], solution_str, row["reward_model"]["ground_truth"], row.get("extra_info"))


@dataclass
class RewardResult:
    """The outcome of scoring one completion. A failure has score 0.0 and a non-empty error."""

    score: float  # the reward
    info: dict[str, float] = field(default_factory=dict)  # other numeric outputs; Trajectory.reward_info
    error: str = ""  # why scoring failed ("timeout after 2s", "ValueError: ..."); Trajectory.reward_error

    @property
    def failed(self) -> bool:
        return bool(self.error)

    @classmethod
    def failure(cls, error: str) -> RewardResult:
        return cls(score=0.0, error=error)


def result_from_return(value: Any) -> RewardResult:
    """Turn what a verl reward function returned (a number, or a dict with "score") into a result.

    A return value that is not a finite number is a failure, not a reward: a NaN would poison every
    advantage of its group.
    """
    if isinstance(value, dict):
        if SCORE_KEY not in value:
            keys = ", ".join(map(str, value))
            return RewardResult.failure(f"reward function returned a dict without '{SCORE_KEY}' (keys: {keys})")
        score, info = value[SCORE_KEY], _numeric_entries(value)
    else:
        score, info = value, {}
    if not _is_number(score):
        return RewardResult.failure(
            f"reward function returned a {type(score).__name__} score; expected a number or a dict with '{SCORE_KEY}'"
        )
    if not math.isfinite(score):
        return RewardResult.failure(f"reward function returned a non-finite score: {score}")
    return RewardResult(score=float(score), info=info)


def _numeric_entries(returned: dict[Any, Any]) -> dict[str, float]:
    """The dict's other numeric entries; strings and the like (verl's "pred") have no place in reward_info."""
    return {str(key): float(value) for key, value in returned.items() if key != SCORE_KEY and _is_number(value)}


def _is_number(value: Any) -> bool:
    # numbers.Real covers bool, int, float and numpy's scalars; strings convertible by float() are not rewards
    return isinstance(value, numbers.Real)
