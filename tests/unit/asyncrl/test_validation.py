"""Unbiased pass@k and the val/* metrics, checked against values computed by hand."""

import pytest

from asyncrl.config import ConfigError, load_config
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


def test_mean_score_per_response_length_bucket():
    outcomes = [
        PromptOutcome("scratchpad", [1.0, 0.0, 1.0], lengths=[20, 64, 65]),
        PromptOutcome("scratchpad", [0.0, 1.0, 0.5], lengths=[300, 1000, 1]),
    ]
    metrics = validation_metrics(outcomes, k=1, length_buckets=[64, 128, 256])
    buckets = {name: value for name, value in metrics.items() if "/bucket/" in name}
    assert buckets == {
        "val/score/bucket/1-64": pytest.approx((1.0 + 0.0 + 0.5) / 3), "val/samples/bucket/1-64": 3.0,  # 20, 64, 1
        "val/score/bucket/65-128": 1.0, "val/samples/bucket/65-128": 1.0,  # 65
        "val/score/bucket/257-inf": 0.5, "val/samples/bucket/257-inf": 2.0,  # 300, 1000; 129-256 is empty
    }
    assert not any("/bucket/" in name for name in validation_metrics(outcomes, k=1))  # no buckets configured


@pytest.mark.parametrize("buckets", [[64, 64], [128, 64], [0, 64]])
def test_length_buckets_must_be_increasing_token_counts(buckets):
    with pytest.raises(ConfigError, match=r"validation.length_buckets: .* must be token counts >= 1 in increasing order"):
        load_config(None, [f"validation.length_buckets=[{','.join(map(str, buckets))}]"])
