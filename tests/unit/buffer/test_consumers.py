"""Read positions per consumer: a new consumer starts from a copy of the learner's window, each moves alone,
and the number of consumers is bounded without ever forgetting the committer."""

from __future__ import annotations

from buffer.consumers import FIRST, ConsumerWindows
from buffer.window import BatchLimits, Entry, PendingWindow


def window_of(count: int) -> PendingWindow:
    window = PendingWindow(0)
    for offset in range(count):
        window.append(Entry(offset, nbytes=10, num_samples=1, num_tokens=4, response_tokens=2, oldest_version=0,
                            learner_version_at_start=0))
    return window


def test_a_new_consumer_starts_where_the_committer_stands_and_moves_alone():
    consumers = ConsumerWindows(window_of(6), limit=4)
    consumers.select(b"learner")
    consumers.current.take(BatchLimits(0, 1, max_samples=2))
    consumers.current_commits()
    consumers.select(b"other")
    assert consumers.current.position() == (2, [])
    taken = consumers.current.take(BatchLimits(0, 1, max_samples=3)).taken
    assert [entry.offset for entry in taken] == [2, 3, 4]
    consumers.select(b"learner")
    assert consumers.current.position() == (2, []) and len(consumers.current) == 4 and consumers.current.bytes == 40


def test_past_the_limit_the_least_recent_consumer_is_forgotten_never_the_committer():
    consumers = ConsumerWindows(window_of(3), limit=3)
    consumers.select(b"learner")
    consumers.current_commits()
    for client in (b"a", b"b", b"c"):
        consumers.select(client)
    assert len(consumers) == 3
    consumers.select(b"learner")  # still there, with its window
    assert consumers.learner is consumers.current
    kept = {id(window) for window in consumers}
    consumers.select(FIRST)  # forgotten long ago: starts again from a copy of the learner's window
    assert id(consumers.current) not in kept and consumers.current.position() == consumers.learner.position()


def test_peeking_at_a_consumer_not_kept_copies_and_forgets_nothing():
    consumers = ConsumerWindows(window_of(3), limit=2)
    consumers.select(b"learner")
    consumers.current_commits()
    consumers.select(b"a")
    assert consumers.peek(b"never-seen") is consumers.learner
    assert consumers.peek(b"a") is consumers.current
    assert len(consumers) == 2
