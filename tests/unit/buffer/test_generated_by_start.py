"""The generated work in hand-out order (oldest start first, then as stored): as many samples as the learner was
handed, by hand; and the versions taken whole folded away, so that a job of days keeps no record per group."""

from buffer.metrics import GeneratedByStart


def test_the_first_groups_in_hand_out_order_that_hold_the_samples_asked_for():
    generated = GeneratedByStart()
    generated.add(3, samples=2, response_tokens=10)
    generated.add(4, samples=2, response_tokens=4)  # version 4: a short group stored first, then a long one
    generated.add(4, samples=2, response_tokens=40)
    assert generated.first(0) == (0, 0)
    assert generated.first(2) == (2, 10)
    assert generated.first(3) == (4, 14), "whole groups, in the order stored within a version"
    generated.add(1, samples=2, response_tokens=200)  # a long group that started first is stored last
    assert generated.first(4) == (4, 210), "it comes first, as the buffer hands it out"
    assert generated.first(6) == (6, 214), "and pushes the last group taken before out"
    assert generated.first(50) == (8, 254), "fewer stored than asked for: all of them"


def test_a_late_group_under_a_folded_version_comes_before_every_open_one():
    generated = GeneratedByStart()
    for version, tokens in ((0, 5), (1, 7), (2, 9)):
        generated.add(version, samples=2, response_tokens=tokens)
    assert generated.first(4) == (4, 12)  # versions 0 and 1 taken whole: folded
    assert generated.settled_through == 1 and sorted(generated.groups) == [2]
    generated.add(0, samples=2, response_tokens=100)  # stored late, started under version 0
    assert generated.first(4) == (6, 112), "more folded samples than asked for: all of them, never a split"
    assert generated.first(6) == (6, 112)
    assert generated.first(8) == (8, 121), "version 2 after the late group, as the buffer would hand them out"


def test_a_long_job_keeps_only_the_versions_not_yet_taken_whole():
    generated = GeneratedByStart()
    for version in range(10_000):
        generated.add(version, samples=2, response_tokens=version % 7)
        generated.first(2 * version)  # the learner has taken every group of the older versions
    assert sorted(generated.groups) == [9_999]
    assert generated.first(20_000) == (20_000, sum(version % 7 for version in range(10_000)))
    assert generated.groups == {}
