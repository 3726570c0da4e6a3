"""The learning rate per optimizer step: linear warm-up, then constant or cosine, against hand-worked values."""

import math

import pytest
import torch

from asyncrl.config.learner import LearnerConfig
from learner.maths.lr_schedule import learning_rate, set_learning_rate


def test_linear_warm_up_then_constant():
    settings = LearnerConfig(lr=1e-3, warmup_steps=4, total_steps=10)
    assert [learning_rate(step, settings) for step in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_no_warm_up_starts_at_the_peak():
    assert learning_rate(0, LearnerConfig(lr=2e-5)) == 2e-5


def test_cosine_decays_from_the_peak_and_its_last_step_stops_one_decay_step_short_of_the_floor():
    settings = LearnerConfig(lr=1.0, warmup_steps=2, total_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    assert learning_rate(1, settings) == pytest.approx(1.0)  # end of the warm-up
    assert learning_rate(2, settings) == pytest.approx(1.0)  # decay starts at the peak
    # a quarter of the 8 decay steps: 0.1 + 0.9 · (1 + cos(π/4)) / 2
    assert learning_rate(4, settings) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert learning_rate(6, settings) == pytest.approx(0.55)  # halfway: 0.1 + 0.9 · (1 + cos(π/2)) / 2
    # the loop runs steps 0 to total_steps − 1 (learner/loop.py), so its last is step 9, at 7 of the 8 decay
    # steps: 0.1 + 0.9 · (1 + cos(7π/8)) / 2 = 0.1 + 0.9 · (1 − 0.9238795) / 2 = 0.1342542
    assert learning_rate(settings.total_steps - 1, settings) == pytest.approx(0.1342542)
    # the floor is where the cosine would be at version total_steps, a step no loop runs; past it, it stays there
    assert learning_rate(50, settings) == pytest.approx(0.1)


def test_the_rate_is_set_on_every_parameter_group():
    optimizer = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(1))]},
                                   {"params": [torch.nn.Parameter(torch.ones(1))]}], lr=1.0)
    set_learning_rate(optimizer, 0.25)
    assert [group["lr"] for group in optimizer.param_groups] == [0.25, 0.25]
