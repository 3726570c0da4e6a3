"""Unbiased pass@k and the val/* metrics, checked against values computed by hand."""

import pytest

from asyncrl.validation_scores import PromptOutcome, pass_at_k, validation_metrics


@pytest.mark.parametrize(
    ("n", "correct", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # c/n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 4, 1.0),  # n - c < k: any 4 of 5 include a correct one
        (5, 0, 3, 0.0),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (8, 3, 3, 1 - 10 / 56),  # 1 - C(5,3)/C(8,3)
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, correct, k, expected):
    assert pass_at_k(n, correct, k) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "correct", "k"), [(4, 1, 5), (4, 1, 0), (4, 5, 1)])
def test_pass_at_k_rejects_impossible_arguments(n, correct, k):
    with pytest.raises(ValueError):
        pass_at_k(n, correct, k)


def test_metrics_overall_and_per_data_source():
    outcomes = [
        PromptOutcome("arithmetic", [1.0, 0.0, 0.0, 0.0]),  # pass@2 = 1 - C(3,2)/C(4,2) = 0.5
        PromptOutcome("arithmetic", [1.0, 1.0, 0.0, 0.0]),  # pass@2 = 1 - C(2,2)/C(4,2) = 5/6
        PromptOutcome("gsm8k", [0.0, 0.0, 0.0, 0.5]),  # partial credit is not a pass: pass@2 = 0
    ]
    metrics = validation_metrics(outcomes, k=2)
    assert metrics["val/score/mean"] == pytest.approx(3.5 / 12)
    assert metrics["val/pass@2"] == pytest.approx((0.5 + 5 / 6 + 0.0) / 3)
    assert metrics["val/prompts"] == 3.0
    assert metrics["val/arithmetic/score/mean"] == pytest.approx(3 / 8)
    assert metrics["val/arithmetic/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert metrics["val/arithmetic/prompts"] == 2.0
    assert metrics["val/gsm8k/score/mean"] == pytest.approx(0.125)
    assert metrics["val/gsm8k/pass@2"] == 0.0


def test_no_outcomes_give_no_metrics():
    assert validation_metrics([], k=1) == {}
