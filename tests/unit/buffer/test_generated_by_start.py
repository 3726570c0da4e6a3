"""The generated work counted in hand-out order (oldest start first, then as stored), as many samples as the
learner was handed, by hand; a group stored late counts at the next hand-out, never retroactively; only the
groups not yet counted are kept."""

from buffer.metrics import GeneratedByStart


def test_each_hand_out_counts_whole_groups_oldest_start_first_then_as_stored():
    generated = GeneratedByStart()
    generated.add(4, samples=2, response_tokens=4)  # version 4: a short group stored first, then a long one
    generated.add(4, samples=2, response_tokens=40)
    generated.add(3, samples=2, response_tokens=10)
    generated.hand_out(0)
    assert generated.taken == (0, 0)
    generated.hand_out(2)
    assert generated.taken == (2, 10), "the oldest start version first, though stored last"
    generated.hand_out(3)
    assert generated.taken == (4, 14), "whole groups, in the order stored within a version"
    generated.hand_out(50)
    assert generated.taken == (6, 54), "fewer stored than handed out: all of them"


def test_a_group_stored_late_under_an_old_version_counts_at_the_next_hand_out_only():
    generated = GeneratedByStart()
    for version, tokens in ((0, 5), (1, 7), (2, 9)):
        generated.add(version, samples=2, response_tokens=tokens)
    generated.hand_out(4)
    assert generated.taken == (4, 12)
    generated.add(0, samples=2, response_tokens=100)  # stored late, started under version 0
    assert generated.taken == (4, 12), "nothing more was handed out: the late group waits, as in the buffer"
    generated.hand_out(6)
    assert generated.taken == (6, 112), "handed out next, before the younger version 2"
    generated.hand_out(8)
    assert generated.taken == (8, 121)


def test_a_dropped_group_counts_in_the_place_it_held():
    """The buffer drops a group that started outside the bound and hands out the next one: the learner trains
    the short group, the generated side counts the long dropped one in its place, and the ratio shows it."""
    generated = GeneratedByStart()
    generated.add(0, samples=2, response_tokens=200)  # dropped as stale at the hand-out
    generated.add(5, samples=2, response_tokens=10)  # handed out
    generated.hand_out(2)
    assert generated.taken == (2, 200)


def test_a_long_job_keeps_only_the_groups_not_yet_counted():
    generated = GeneratedByStart()
    for version in range(10_000):
        generated.add(version, samples=2, response_tokens=version % 7)
        generated.add(version, samples=2, response_tokens=1)
        generated.hand_out(4 * version + 2)  # the learner has taken every group but the newest
    assert list(generated.pending) == [9_999] and len(generated.pending[9_999]) == 1
    generated.hand_out(40_000)
    assert generated.taken == (40_000, sum(version % 7 + 1 for version in range(10_000)))
    assert generated.pending == {}
