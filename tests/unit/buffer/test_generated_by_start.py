"""The generated work in hand-out order (oldest start first, then as stored): as many samples as the learner was
handed, by hand."""

from buffer.metrics import GeneratedByStart


def test_the_first_groups_in_hand_out_order_that_hold_the_samples_asked_for():
    generated = GeneratedByStart()
    generated.add(3, samples=2, response_tokens=10)
    generated.add(4, samples=2, response_tokens=4)  # version 4: a short group stored first, then a long one
    generated.add(4, samples=2, response_tokens=40)
    assert generated.first(0) == (0, 0)
    assert generated.first(2) == (2, 10)
    assert generated.first(3) == (4, 14), "whole groups, in the order stored within a version"
    assert generated.first(6) == (6, 54)
    generated.add(1, samples=2, response_tokens=200)  # a long group that started first is stored last
    assert generated.first(4) == (4, 210), "it comes first, as the buffer hands it out"
    assert generated.first(50) == (8, 254), "fewer stored than asked for: all of them"
