from __future__ import annotations

from buffer.admission import Admission


def test_grant_follows_the_areal_formula():
    admission = Admission(max_staleness=2, batch_groups=8, timeout_s=10)
    # (K + version + 1) * batch - (accepted + running) = (2 + 0 + 1) * 8 - (5 + 0) = 19
    assert admission.capacity(version=0, accepted=5) == 19
    assert admission.grant("a", wanted=12, finished=0, version=0, accepted=5, now=0) == 12
    assert admission.grant("b", wanted=12, finished=0, version=0, accepted=5, now=0) == 7  # 19 - 12
    assert admission.running == 19 and admission.waits == 1
    assert admission.grant("b", wanted=1, finished=0, version=0, accepted=5, now=1) == 0
    # a new learner version widens the window by one batch
    assert admission.grant("b", wanted=20, finished=0, version=1, accepted=5, now=2) == 8
    assert admission.capacity(version=1, accepted=5) == 0


def test_finished_groups_return_capacity_and_are_never_negative():
    admission = Admission(max_staleness=0, batch_groups=4, timeout_s=10)
    assert admission.grant("a", 4, 0, version=0, accepted=0, now=0) == 4
    assert admission.grant("a", 4, finished=3, version=0, accepted=3, now=1) == 0  # sent: now accepted
    assert admission.grant("a", 4, finished=10, version=0, accepted=3, now=2) == 1  # over-report clamps to 0 running
    assert admission.running == 1


def test_a_silent_server_is_released_after_the_timeout():
    admission = Admission(max_staleness=0, batch_groups=4, timeout_s=5)
    admission.grant("dead", 4, 0, version=0, accepted=0, now=0)
    admission.grant("alive", 4, 0, version=0, accepted=0, now=4)
    admission.expire(now=4.9)
    assert admission.running == 4
    admission.expire(now=5.1)
    assert admission.released == 4 and admission.running == 0
    assert admission.grant("alive", 4, 0, version=0, accepted=0, now=5.2) == 4


def test_wait_time_is_measured_from_the_first_short_grant():
    admission = Admission(max_staleness=0, batch_groups=1, timeout_s=100)
    admission.grant("a", 1, 0, version=0, accepted=1, now=10)
    admission.grant("a", 1, 0, version=0, accepted=1, now=11)
    admission.grant("a", 1, 0, version=1, accepted=1, now=13.5)
    assert admission.waits == 2 and admission.wait_s == 3.5


def test_a_resent_request_gets_the_first_answer_and_counts_once():
    admission = Admission(max_staleness=0, batch_groups=4, timeout_s=10)
    assert admission.grant("a", 3, 0, version=0, accepted=0, now=0, request_id="x-1") == 3
    assert admission.grant("a", 3, finished=2, version=0, accepted=2, now=1, request_id="x-2") == 1  # 4 - (2 + 1)
    # its reply was lost: the resend neither returns the 2 finished groups again nor grants again
    assert admission.grant("a", 3, finished=2, version=0, accepted=2, now=2, request_id="x-2") == 1
    assert admission.running == 2
    assert admission.grant("a", 3, finished=0, version=0, accepted=2, now=3, request_id="x-3") == 0
    assert admission.waits == 2  # x-2 and x-3; the resend is not another wait
    # requests without an id are never taken for repeats: (0 + 1 + 1) * 4 - (2 + 2) = 4 left
    assert [admission.grant("b", 1, 0, version=1, accepted=2, now=4) for _ in range(2)] == [1, 1]
    assert admission.running == 4


def test_a_restarted_buffer_counts_what_servers_report_running():
    before = Admission(max_staleness=1, batch_groups=4, timeout_s=10)
    assert before.grant("a", wanted=6, finished=0, version=0, accepted=0, now=0, running=0) == 6
    restarted = Admission(max_staleness=1, batch_groups=4, timeout_s=10)  # its counts start empty
    # "a" has finished 2 of its 6 since; it reports the 4 still running, and only 8 - 4 may start
    assert restarted.grant("a", wanted=6, finished=2, version=0, accepted=2, now=1, running=4) == 2
    assert restarted.running == 6
    # without the report, the same request would have been granted past the bound
    legacy = Admission(max_staleness=1, batch_groups=4, timeout_s=10)
    assert legacy.grant("a", wanted=6, finished=2, version=0, accepted=2, now=1) == 6
