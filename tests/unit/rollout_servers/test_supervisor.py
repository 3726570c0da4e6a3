"""The local supervisor's restart policy: back-off per quick death in a row, a fresh count after a healthy
run, and giving up with the reason (`schedule_restart`; the processes are stand-ins with an exit code); a server
that cannot import its code exits as one that cannot start."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from asyncrl.config.rollout import RolloutConfig
from asyncrl.exit_codes import CANNOT_START
from asyncrl.restarts import QuickDeaths
from rollout_servers.server_logs import server_error_file
from rollout_servers.supervisor import ServerCannotStart, ServerKeepsFailing, ServerSlot, schedule_restart

SETTINGS = RolloutConfig(restart_backoff_s=2.0, restart_backoff_max_s=10.0, healthy_after_s=300.0, max_restarts=4)


@dataclass
class DeadProcess:
    exitcode: int


def die(slot: ServerSlot, after_s: float, code: int = 1, run_dir=".", error: str | None = None) -> float:
    """The slot's process dies `after_s` after it started, leaving `error` in its error file (None: nothing); returns
    the delay booked before the next start."""
    now = slot.started_at + after_s
    slot.process = DeadProcess(code)
    recorded = server_error_file(run_dir, 0)
    recorded.unlink(missing_ok=True)  # what each server process does as it starts
    if error is not None:
        recorded.parent.mkdir(parents=True, exist_ok=True)
        recorded.write_text(error + "\n")
    schedule_restart(slot, 0, run_dir, now)
    assert slot.process is None
    delay = slot.next_start - now
    slot.started_at = slot.next_start  # restarted when due
    return delay


def test_quick_deaths_double_the_back_off_up_to_its_cap_then_give_up_naming_keys_and_log(tmp_path):
    slot = ServerSlot(QuickDeaths.of(SETTINGS, SETTINGS.max_restarts))
    assert [die(slot, after_s=5.0) for _ in range(4)] == [2.0, 4.0, 8.0, 10.0]
    with pytest.raises(ServerKeepsFailing) as raised:
        die(slot, after_s=5.0, code=-9, run_dir=tmp_path)
    message = str(raised.value)
    assert "server-0 keeps dying: death 5 in a row" in message and "rollout.max_restarts=4" in message
    assert "rollout.healthy_after_s=300s" in message and "last exit code -9" in message
    assert str(tmp_path / "logs" / "rollout0.log") in message


def test_a_server_that_ran_healthy_starts_its_count_afresh():
    slot = ServerSlot(QuickDeaths.of(SETTINGS, SETTINGS.max_restarts))
    assert [die(slot, after_s=1.0) for _ in range(4)] == [2.0, 4.0, 8.0, 10.0]
    assert die(slot, after_s=300.0) == 2.0  # ran long enough: back to the first delay, count 1
    assert [die(slot, after_s=1.0) for _ in range(3)] == [4.0, 8.0, 10.0]
    with pytest.raises(ServerKeepsFailing):
        die(slot, after_s=1.0)


def test_a_server_that_cannot_start_is_not_restarted():
    slot = ServerSlot(QuickDeaths.of(SETTINGS, SETTINGS.max_restarts))
    with pytest.raises(ServerCannotStart, match="cannot start from this config or install"):
        die(slot, after_s=1.0, code=CANNOT_START)


ENGINE_ERROR = "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"


def test_the_same_error_at_two_quick_deaths_in_a_row_gives_up_at_once_naming_it(tmp_path):
    # an engine that cannot run the model fails alike at every start: no back-off for minutes while the learner waits
    slot = ServerSlot(QuickDeaths.of(SETTINGS, SETTINGS.max_restarts))
    assert die(slot, after_s=60.0, run_dir=tmp_path, error=ENGINE_ERROR) == 2.0
    with pytest.raises(ServerCannotStart) as raised:
        die(slot, after_s=60.0, run_dir=tmp_path, error=ENGINE_ERROR)
    message = str(raised.value)
    assert message.startswith("server-0 cannot run this config or install (not restarted again): the same error "
                              "ended 2 starts in a row, each within rollout.healthy_after_s=300s: " + ENGINE_ERROR)
    assert str(tmp_path / "logs" / "rollout0.log") in message
    assert raised.value.exit_code == CANNOT_START


def test_different_errors_or_unknown_ones_or_a_healthy_run_between_them_keep_the_back_off(tmp_path):
    slot = ServerSlot(QuickDeaths.of(SETTINGS, SETTINGS.max_restarts))
    assert die(slot, after_s=5.0, run_dir=tmp_path, error="ValueError: one") == 2.0
    assert die(slot, after_s=5.0, run_dir=tmp_path, error="ValueError: another") == 4.0
    assert die(slot, after_s=5.0, run_dir=tmp_path) == 8.0  # killed by a signal, say: no error recorded
    assert die(slot, after_s=5.0, run_dir=tmp_path) == 10.0  # twice unknown is not the same error
    slot = ServerSlot(QuickDeaths.of(SETTINGS, SETTINGS.max_restarts))
    assert die(slot, after_s=5.0, run_dir=tmp_path, error="ValueError: one") == 2.0
    assert die(slot, after_s=300.0, run_dir=tmp_path, error="ValueError: one") == 2.0  # ran healthy in between
    assert die(slot, after_s=5.0, run_dir=tmp_path, error="ValueError: one") == 4.0  # the first quick one of a row
    with pytest.raises(ServerCannotStart, match="the same error ended 2 starts in a row"):
        die(slot, after_s=5.0, run_dir=tmp_path, error="ValueError: one")


def test_no_restarts_allowed_gives_up_at_the_first_quick_death():
    slot = ServerSlot(QuickDeaths.of(RolloutConfig(), max_restarts=0), process=DeadProcess(1))
    with pytest.raises(ServerKeepsFailing, match="death 1 in a row"):
        schedule_restart(slot, 0, ".", now=1.0)


SERVE_ONE_WITHOUT_ITS_SERVER_MODULE = """
import sys
from asyncrl.config import load_config
from rollout_servers import server_process
from rollout_servers.learner_wait import Endpoints

sys.modules["rollout_servers.server"] = None  # importing it raises ImportError, as a broken vLLM install does
server_process.serve_one(load_config(None, []), 0, Endpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), sys.argv[1])
"""


def test_a_server_whose_code_cannot_import_exits_cannot_start_and_logs_why(tmp_path):
    """A broken install fails every restart alike: the server exits CANNOT_START (the supervisor gives up at once)
    instead of 1 (restarted with back-off, ten times over minutes, while the learner waits for it)."""
    done = subprocess.run([sys.executable, "-c", SERVE_ONE_WITHOUT_ITS_SERVER_MODULE, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == CANNOT_START, done.stderr[-2000:]
    assert "server-0 cannot start: ModuleNotFoundError" in (tmp_path / "logs" / "rollout0.log").read_text()
