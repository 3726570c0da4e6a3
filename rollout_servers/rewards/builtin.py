"""Built-in scorers, picked by a sample's `data_source`, behind verl's reward-function signature.

A data source is looked up by exact name first, then by keyword ("gsm8k", "math", ... anywhere in the
name, case-insensitive), so that variants such as "my-org/math-hard" reach the math scorer. A name that
matches nothing raises `UnknownDataSourceError`; `check_data_sources` raises it at startup.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from asyncrl.data.builtin_sources import EXACT_MATCH_SOURCE, FINAL_ANSWER_MARK, SCRATCHPAD_SOURCE
from rollout_servers.rewards.math_answers import score_math_answer

AnswerScorer = Callable[[str, Any], float]  # (solution_str, ground_truth) -> reward


def exact_match(solution_str: str, ground_truth: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the answer."""
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0


def final_answer_match(solution_str: str, ground_truth: str) -> float:
    """1.0 when the completion's last line is the final-answer mark followed exactly by the answer; the working
    above it is not scored (a slip in it shows in the answer it leads to)."""
    lines = solution_str.strip().splitlines()
    last = lines[-1] if lines else ""
    return exact_match(last[len(FINAL_ANSWER_MARK):], ground_truth) if last.startswith(FINAL_ANSWER_MARK) else 0.0


# data sources of verl's example datasets and recipes whose answers math-verify can check
MATH_DATA_SOURCES = (
    "openai/gsm8k",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math",
    "math_dapo",
)
MATH_KEYWORDS = ("gsm8k", "math", "aime")

SCORERS_BY_NAME: dict[str, AnswerScorer] = {
    EXACT_MATCH_SOURCE: exact_match,
    SCRATCHPAD_SOURCE: final_answer_match,
    **{name: score_math_answer for name in MATH_DATA_SOURCES},
}
SCORERS_BY_KEYWORD: dict[str, AnswerScorer] = {keyword: score_math_answer for keyword in MATH_KEYWORDS}


class UnknownDataSourceError(ValueError):
    """No built-in scorer handles this data source (and no custom reward function is configured)."""


def scorer_for(data_source: str) -> AnswerScorer:
    """The built-in scorer for a data source: exact name first, then the first keyword it contains."""
    if data_source in SCORERS_BY_NAME:
        return SCORERS_BY_NAME[data_source]
    lowered = data_source.lower()
    for keyword, scorer in SCORERS_BY_KEYWORD.items():
        if keyword in lowered:
            return scorer
    raise UnknownDataSourceError(
        f"no built-in scorer for data_source '{data_source}': known names {sorted(SCORERS_BY_NAME)}, "
        f"or a name containing one of {list(MATH_KEYWORDS)}; set reward.custom_fn.path for other data"
    )


def check_data_sources(data_sources: Iterable[str]) -> None:
    """Raise `UnknownDataSourceError` for the first data source without a built-in scorer."""
    for data_source in sorted(set(data_sources)):
        scorer_for(data_source)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """verl's reward-function signature over the built-in scorers; custom functions may call it too."""
    return scorer_for(data_source)(solution_str, ground_truth)
