"""The learner-share benchmark's reading of a synchronous run (scripts/bench_learner_share.py): the timed steps'
figures on hand-written records, and the check that every trained sample is as long as its prompt's cap."""

import pytest

from asyncrl.messages import Trajectory, TrajectoryGroup
from launch.reference_loop import frames, write_trained
from scripts.bench_learner_share import check_lengths, job_overrides, step_figures


def step(number: int, wait_s: float, train_s: float, step_s: float, length: float) -> dict:
    return {"step": number, "batch/samples": 4, "response_length/mean": length, "timing_s/wait_batch": wait_s,
            "timing_s/train": train_s, "timing_s/step": step_s}


def test_the_figures_are_the_timed_steps_medians_the_mean_share_and_tokens_over_their_time():
    records = [{"step": 0, "val/score/mean": 0.5}, step(1, 9.0, 3.0, 12.5, 50.0), step(2, 2.0, 1.0, 3.0, 100.0),
               step(3, 4.0, 2.0, 6.5, 200.0), step(4, 3.0, 1.0, 4.5, 150.0)]
    figures = step_figures(records, skip=1)
    assert figures["steps_timed"] == 3  # step 1 (warm-up) and the record without timings left out
    assert figures["tokens_per_step"] == pytest.approx((400 + 800 + 600) / 3, abs=0.05)
    assert (figures["generation_s"], figures["training_s"], figures["step_s"]) == (3.0, 1.0, 4.5)
    assert figures["learner_share"] == pytest.approx((1 / 3 + 2 / 6.5 + 1 / 4.5) / 3, abs=1e-4)
    assert figures["trained_tokens_per_s"] == pytest.approx(1800 / 14.0, abs=0.05)


def group(group_id: str, *samples: tuple[list[int], int]) -> TrajectoryGroup:
    """A trained group of samples (prompt ids, response length)."""
    return TrajectoryGroup(group_id, group_id, "reference", [
        Trajectory(prompt, [7] * length, [-1.0] * length, [0] * length, [1] * length, 0.0, group_id, "synthetic",
                   "length") for prompt, length in samples])


def test_every_trained_sample_must_be_as_long_as_its_prompt_s_cap(tmp_path):
    caps = {(1, 2): 3, (4, 5, 6): 5}
    write_trained(tmp_path, 1, frames([group("g1", ([1, 2], 3), ([4, 5, 6], 5))]))
    write_trained(tmp_path, 2, frames([group("g2", ([4, 5, 6], 5))]))
    check_lengths(tmp_path, 2, caps)

    write_trained(tmp_path, 2, frames([group("g2", ([4, 5, 6], 4))]))
    with pytest.raises(SystemExit, match="step 2, group g2: a response of 4 tokens where its prompt's cap is 5"):
        check_lengths(tmp_path, 2, caps)
    write_trained(tmp_path, 2, frames([group("g2", ([9], 4))]))
    with pytest.raises(SystemExit, match="cap is None"):  # a prompt the capped rows never had
        check_lengths(tmp_path, 2, caps)


def test_a_candidate_s_job_is_synchronous_with_eos_ignored_validation_off_and_everything_under_its_place(tmp_path):
    overrides = dict(item.split("=", 1) for item in job_overrides(tmp_path, steps=5))
    assert overrides["learner.mode"] == "synchronous" and overrides["rollout.sampling.ignore_eos"] == "true"
    assert overrides["validation.every"] == "0" and overrides["learner.total_steps"] == "5"
    assert int(overrides["learner.checkpoint_every"]) > 5
    assert all(str(tmp_path) in overrides[key] for key in ("model.path", "data.train_files", "run.root_dir"))
