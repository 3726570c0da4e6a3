"""Math answers checked by Hugging Face's math-verify: equal values count, whatever their notation.

"\\boxed{\\frac{1}{2}}" matches "0.5"; "The answer is $2$" matches "2". The completion is parsed as
math-verify does by default (boxed answers first, then LaTeX and plain expressions).
"""

from __future__ import annotations

from typing import Any

from math_verify import parse, verify

# a ground truth already in LaTeX form is parsed as it is; a bare one ("0.5", "\\frac34") is boxed first
_LATEX_ANSWER_MARKERS = ("$", "\\boxed", "\\(", "\\[")


def score_math_answer(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the completion's answer equals the ground truth mathematically, else 0.0."""
    gold = parse(_as_latex_answer(str(ground_truth)))
    if not gold:
        # a data problem, not a wrong answer: raising records it on the sample instead of a silent 0
        raise ValueError(f"ground truth {ground_truth!r} holds no answer math-verify can parse")
    answer = parse(solution_str)
    return 1.0 if verify(gold, answer) else 0.0


def _as_latex_answer(ground_truth: str) -> str:
    """Bare answers are boxed: math-verify then reads "1+x^2" whole, not just its first number."""
    if any(marker in ground_truth for marker in _LATEX_ANSWER_MARKERS):
        return ground_truth
    return f"\\boxed{{{ground_truth.strip()}}}"
