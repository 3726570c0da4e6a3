"""The learner's progress line: one field per metric present, in a fixed order, so a user sees which side waits."""

from learner.services.rank_services import progress_line


def test_shows_the_step_and_the_metrics_present_with_the_wait_beside_the_step_time():
    metrics = {"critic/score/mean": 0.5, "staleness/mean": 1.25, "staleness/max_staleness": 2, "timing_s/wait_batch": 0.0421,
               "timing_s/step": 1.5, "rollout/tokens_per_s": 1234.6}
    assert progress_line(7, 200, metrics) == (
        "step 7/200 reward 0.500 staleness 1.250 K 2 gen_tok/s 1235 wait_s 0.042 step_s 1.500")


def test_a_step_without_metrics_shows_only_its_number():
    assert progress_line(1, 10, {}) == "step 1/10"
