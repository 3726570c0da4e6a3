from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.staleness import staleness, starts_within_bound
from buffer.window import BatchLimits, Entry, PendingWindow


def window_of(versions: list[int], samples: int = 2, tokens: int = 10, start: int = 0,
              started_at: list[int] | None = None) -> PendingWindow:
    """Groups whose oldest tokens have `versions`, started while the learner was at `started_at` (by default at
    their own version: from the learner's newest weights)."""
    window = PendingWindow(start)
    for index, (version, learner) in enumerate(zip(versions, started_at or versions)):
        window.append(Entry(start + index, 7, samples, tokens, samples * 3, version, learner))
    return window


def test_groups_that_started_outside_the_bound_are_dropped_whole_and_counted():
    # each started while the learner was at 5: from weights 0..5 versions behind it
    window = window_of([0, 3, 1, 4, 2, 5], started_at=[5] * 6)
    selection = window.take(BatchLimits(policy_version=5, max_staleness=2))  # keeps starts at versions >= 3
    assert [e.oldest_version for e in selection.taken] == [3, 4, 5]
    assert [e.offset for e in selection.dropped] == [0, 2, 4]
    assert selection.staleness == [2, 1, 0]
    assert (window.read_offset, len(window), window.bytes) == (6, 0, 0)


def test_a_long_group_that_started_within_the_bound_is_handed_out_however_stale_it_is_now():
    # started at version 1 from the learner's own weights; the learner reached 9 while it generated
    window = window_of([1, 9], started_at=[1, 9])
    selection = window.take(BatchLimits(policy_version=9, max_staleness=2))
    assert [e.offset for e in selection.taken] == [0, 1] and not selection.dropped
    assert selection.staleness == [8, 0]  # measured, not held against it


def test_k_zero_hands_out_only_groups_started_from_the_learners_weights():
    window = window_of([4, 5, 5, 4], started_at=[5, 5, 5, 4])
    selection = window.take(BatchLimits(policy_version=5, max_staleness=0))
    assert [e.offset for e in selection.taken] == [1, 2, 3]  # offset 3 started at 4 from version 4: within K = 0
    assert [e.offset for e in selection.dropped] == [0]


def test_untrained_groups_and_unknown_starts_are_within_the_bound():
    assert staleness(10, -1) == 0
    selection = window_of([-1, 2], started_at=[10, -1]).take(BatchLimits(10, 0))  # at K = 0
    assert [e.offset for e in selection.taken] == [0, 1] and not selection.dropped


def test_batch_stops_at_the_sample_limit_with_whole_groups():
    window = window_of([0] * 5, samples=4)
    selection = window.take(BatchLimits(0, 0, max_samples=10))
    assert [e.offset for e in selection.taken] == [0, 1]  # a third group would make 12 > 10
    assert selection.full and window.read_offset == 2


def test_batch_by_tokens_and_an_oversized_first_group_still_goes_out():
    window = window_of([0] * 3, tokens=100)
    assert len(window.take(BatchLimits(0, 0, max_tokens=250)).taken) == 2
    assert len(window.take(BatchLimits(0, 0, max_tokens=50)).taken) == 1  # never stuck behind a big group


def test_plan_consumes_nothing():
    window = window_of([0, 1, 2, 3])
    window.plan(BatchLimits(3, 0))
    assert window.position() == (0, []) and len(window) == 4 and window.bytes == 4 * 7


def test_the_oldest_groups_go_first_and_the_position_lists_what_was_taken_ahead():
    window = window_of([5, 3, 5, 4], samples=2)  # the long-running groups (versions 3, 4) arrived late
    selection = window.take(BatchLimits(policy_version=5, max_staleness=2, max_samples=4))
    assert [e.offset for e in selection.taken] == [1, 3] and selection.staleness == [2, 1]
    assert window.position() == (0, [1, 3])
    assert [e.offset for e in window.take(BatchLimits(5, 2, max_samples=2)).taken] == [0]
    assert window.position() == (2, [3])  # the consumed prefix closes up


def test_every_group_that_broke_the_start_rule_is_dropped_even_behind_a_full_batch():
    window = window_of([3, 3, 0, 0], started_at=[3, 3, 3, 3])
    selection = window.take(BatchLimits(policy_version=3, max_staleness=1, max_samples=2))
    assert [e.offset for e in selection.taken] == [0] and [e.offset for e in selection.dropped] == [2, 3]
    assert window.position() == (1, [2, 3])


def test_a_resumed_position_skips_what_it_consumed():
    window = PendingWindow(2, ahead=[4])
    for offset in range(2, 6):
        window.append(Entry(offset, 7, 2, 10, 6, 0, 0))
    assert sorted(window.entries) == [2, 3, 5] and window.bytes == 3 * 7
    window.consume_through(3, [5])  # a commit from before a restart: both sides' consumption counts
    assert window.position() == (3, [4, 5]) and sorted(window.entries) == [3]


@settings(max_examples=200, deadline=None)
@given(starts=st.lists(st.tuples(st.integers(-1, 20), st.integers(0, 6)), max_size=40), policy=st.integers(0, 25),
       k=st.integers(0, 5), max_samples=st.integers(0, 12))
def test_every_handed_out_group_started_within_the_bound_and_every_group_is_accounted_once(starts, policy, k, max_samples):
    """(start version, learner's lead over it when the group started) per group; the learner is at `policy` now."""
    versions = [version for version, _ in starts]
    window = window_of(versions, samples=2, started_at=[version + lead for version, lead in starts])
    seen, dropped = [], []
    while len(window):
        selection = window.take(BatchLimits(policy, k, max_samples=max_samples))
        assert all(starts_within_bound(e.learner_version_at_start, e.oldest_version, k) for e in selection.taken)
        assert selection.staleness == [staleness(policy, e.oldest_version) for e in selection.taken]
        seen += [e.offset for e in selection.taken + selection.dropped]
        dropped += [e.offset for e in selection.dropped]
    assert sorted(seen) == list(range(len(versions)))
    assert sorted(dropped) == [i for i, (version, lead) in enumerate(starts) if version >= 0 and lead > k]


def test_a_batch_stays_within_the_byte_limit():
    window = window_of([0] * 5)  # 7-byte frames
    assert len(window.take(BatchLimits(0, 0, max_bytes=20)).taken) == 2
    assert len(window.take(BatchLimits(0, 0, max_bytes=3)).taken) == 1  # a group alone always goes out
