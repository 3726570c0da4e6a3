"""How `asyncrl run` ends its children: a job that finished lets the rollout supervisor stop by itself (a signal
would reach its engine cores mid-shutdown); any other end signals the group at once; a model the roles cannot serve,
found while they start, stops them."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from asyncrl.config import ConfigError
from launch.commands import run
from launch.commands.run import _stop


def child(seconds: float) -> subprocess.Popen:
    """A process of its own session that exits 0 after `seconds`, as the supervisor does once told the job is done."""
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], start_new_session=True)


def test_a_child_stopping_by_itself_is_waited_for_not_signalled():
    process = child(0.5)
    _stop(process, own_stop_s=30.0)
    assert process.returncode == 0


def test_without_a_wait_the_group_gets_sigterm_at_once():
    process = child(60)
    _stop(process)
    assert process.returncode == -signal.SIGTERM


def test_a_child_that_outlasts_its_wait_is_signalled():
    process = child(60)
    _stop(process, own_stop_s=0.2)
    assert process.returncode == -signal.SIGTERM


def test_a_model_the_roles_cannot_serve_stops_them_and_its_error_is_the_command_s(monkeypatch):
    def refused(config):
        raise ConfigError("model.path: the tokenizer at /m has no chat template")

    monkeypatch.setattr(run, "check_model", refused)
    roles = [child(60), child(60)]
    with pytest.raises(ConfigError, match="no chat template"):
        run.check_model_beside(None, roles)
    assert [process.returncode for process in roles] == [-signal.SIGTERM, -signal.SIGTERM]


def test_a_model_they_can_serve_leaves_the_roles_running(monkeypatch):
    monkeypatch.setattr(run, "check_model", lambda config: None)
    roles = [child(60)]
    run.check_model_beside(None, roles)
    assert roles[0].poll() is None
    _stop(roles[0])
