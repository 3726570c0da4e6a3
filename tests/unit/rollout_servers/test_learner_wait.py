"""A server whose learner is gone says once a minute that it waits, and learns from the run's endpoints file
when the learner is back elsewhere or has finished the job."""

import logging

import pytest

from asyncrl.endpoints import write_endpoints
from rollout_servers.learner_wait import LearnerFinished, LearnerMoved, LearnerWait

BUFFER, SYNC = "tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"


def test_a_wait_is_reported_once_per_period_and_its_end_once(tmp_path, caplog):
    write_endpoints(tmp_path, {"buffer": BUFFER, "sync": SYNC})  # a killed learner's file stays
    wait = LearnerWait(BUFFER, SYNC, tmp_path, report_every_s=3600)
    with caplog.at_level(logging.INFO, logger="rollout_servers.learner_wait"):
        for _ in range(3):
            wait.silent(TimeoutError("no reply"))
        wait.answered()
        wait.answered()
    assert caplog.text.count("waiting for the learner") == 1
    assert caplog.text.count("answers again") == 1


def test_the_first_wait_is_reported_on_a_machine_booted_moments_ago(tmp_path, caplog, monkeypatch):
    # time.monotonic() counts from boot: a report period longer than the uptime must not hide the first line
    monkeypatch.setattr("rollout_servers.learner_wait.time.monotonic", lambda: 5.0)
    wait = LearnerWait(BUFFER, SYNC, None, report_every_s=60)
    with caplog.at_level(logging.INFO, logger="rollout_servers.learner_wait"):
        wait.silent(TimeoutError("no reply"))
    assert caplog.text.count("waiting for the learner") == 1


def test_no_endpoints_file_while_the_learner_restarts_keeps_waiting(tmp_path):
    LearnerWait(BUFFER, SYNC, tmp_path).silent(TimeoutError("no reply"))  # the learner removed it at its start


def test_a_learner_back_elsewhere_or_finished_ends_the_wait(tmp_path):
    wait = LearnerWait(BUFFER, SYNC, tmp_path)
    write_endpoints(tmp_path, {"buffer": "tcp://127.0.0.1:6001", "sync": SYNC})
    with pytest.raises(LearnerMoved, match="6001"):
        wait.silent(TimeoutError("no reply"))
    write_endpoints(tmp_path, {"finished": 40})
    with pytest.raises(LearnerFinished) as finished:
        wait.silent(TimeoutError("no reply"))
    assert finished.value.version == 40
