"""The learner's watch over its own buffer: the restart policy (back-off per quick death in a row, then a clear
error naming buffer.max_restarts), and the supervisor restarting a dead child on the same address, leaving one
stopped by a signal alone, and stopping its child when the learner ends. The buffer is a stand-in here (a
`sleep` process): `tests/integration/test_learner_buffer_restart.py` kills a real one under a real learner."""

from __future__ import annotations

import logging
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncrl.buffer_process import BufferProcess
from asyncrl.config.rollout import RolloutConfig
from asyncrl.restarts import QuickDeaths
from learner.services.buffer_supervisor import BufferNotRestarted, BufferSupervisor, exit_reason, restart_delay
from waiting import wait_until

SETTINGS = RolloutConfig(restart_backoff_s=2.0, restart_backoff_max_s=10.0, healthy_after_s=300.0)
ADDRESS = "tcp://127.0.0.1:5555"
WAIT_S = 30.0  # a stand-in's start and the watcher's next look, on a loaded box


def test_quick_deaths_back_off_doubling_then_fail_naming_the_limit_key(caplog):
    deaths = QuickDeaths.of(SETTINGS, max_restarts=3)
    death = "the buffer on tcp://127.0.0.1:5555 (pid 7) was killed by SIGKILL"
    with caplog.at_level(logging.WARNING):
        assert [restart_delay(deaths, death, 5.0, Path("run/buffer.log")) for _ in range(3)] == [2.0, 4.0, 8.0]
    assert "restarting the buffer in 4.0s, attempt 2 of 3" in caplog.messages[1] and death in caplog.messages[1]
    with pytest.raises(BufferNotRestarted) as raised:
        restart_delay(deaths, death, 5.0, Path("run/buffer.log"))
    message = str(raised.value)
    assert death in message and "buffer.max_restarts=3" in message and "run/buffer.log" in message
    assert "death 4 in a row within rollout.healthy_after_s=300s" in message


def test_a_buffer_that_ran_healthy_starts_its_count_afresh():
    deaths = QuickDeaths.of(SETTINGS, max_restarts=1)
    assert restart_delay(deaths, "died", 1.0, Path("log")) == 2.0
    assert restart_delay(deaths, "died", 300.0, Path("log")) == 2.0
    with pytest.raises(BufferNotRestarted):
        restart_delay(deaths, "died", 1.0, Path("log"))


def test_exit_reasons_name_the_signal_or_the_code():
    assert exit_reason(-signal.SIGKILL) == "was killed by SIGKILL"
    assert exit_reason(1) == "exited with code 1"


@dataclass
class StandInLaunch:
    """Starts `sleep` processes in place of `asyncrl buffer`, all on one address."""

    log_path: Path
    started: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> BufferProcess:
        self.started.append(subprocess.Popen(["sleep", "600"]))
        return BufferProcess(self.started[-1], ADDRESS, self.log_path.parent)

    def at(self, address: str) -> StandInLaunch:
        assert address == ADDRESS
        return self


def gave_up(supervisor: BufferSupervisor) -> BufferNotRestarted | None:
    """Why no buffer will serve again, once the supervisor says so."""
    try:
        supervisor.check()
    except BufferNotRestarted as error:
        return error
    return None


@pytest.fixture
def supervised(tmp_path):
    """A supervisor over stand-ins (no back-off, two restarts in a row allowed), stopped after the test."""
    launch = StandInLaunch(tmp_path / "buffer.log")
    supervisor = BufferSupervisor(launch, QuickDeaths.of(RolloutConfig(restart_backoff_s=0.0), max_restarts=2))
    yield supervisor, launch
    supervisor.stop()
    assert all(process.poll() is not None for process in launch.started), "a buffer outlived its supervisor"


def test_a_killed_buffer_is_restarted_until_the_limit_then_the_learner_is_told(supervised):
    supervisor, launch = supervised
    for restart in (1, 2):
        launch.started[-1].kill()
        wait_until(lambda: supervisor.restarts() == restart, WAIT_S, f"restart {restart}")
        supervisor.check()  # a restarted buffer serves: nothing to raise
    assert len(launch.started) == 3 and supervisor.address == ADDRESS and launch.started[-1].poll() is None
    launch.started[-1].kill()
    error = wait_until(lambda: gave_up(supervisor), WAIT_S, "the supervisor to give up")
    assert "was killed by SIGKILL" in str(error) and "buffer.max_restarts=2" in str(error)
    assert len(launch.started) == 3 and not supervisor.restarting()


def test_a_buffer_stopped_by_a_signal_is_not_restarted(supervised):
    supervisor, launch = supervised
    launch.started[-1].terminate()
    error = wait_until(lambda: gave_up(supervisor), WAIT_S, "the supervisor to notice the stop")
    assert "was killed by SIGTERM: stopped by a signal, so not restarted" in str(error)
    assert len(launch.started) == 1 and supervisor.restarts() == 0


def test_stop_ends_the_running_buffer(supervised):
    supervisor, launch = supervised
    assert supervisor.stop() == -signal.SIGTERM  # `sleep` has no handler: SIGTERM ends it
    assert launch.started[-1].poll() == -signal.SIGTERM
