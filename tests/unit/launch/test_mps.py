"""CUDA MPS for `asyncrl run` (`run.mps`, launch/mps.py) with a stand-in for NVIDIA's control program: when a job
gets a daemon, what its roles are given, whether a server served them, the daemon quitting at the end or dying with
the launcher, and the refusals (run.mps=on without a GPU, without the program, or with a daemon that does not start)
each naming the key."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.config.loader import ConfigError
from asyncrl.placement import Plan
from launch import mps
from launch.mps import CONTROL, LOG_ENV, PIPE_ENV, SERVING_FILE, MpsError, start_mps, wanted

COLOCATED = Plan(learner=(0,), servers=((0,),))
APART = Plan(learner=(1,), servers=((0,),))
LOG = logging.getLogger("test-mps")

# The stand-in: `-f` runs the daemon (it records its environment, makes its socket file, and waits for a quit);
# without arguments it is the client, which passes a "quit" on stdin to the daemon or answers "get_server_list" with
# one server's pid (none with STAND_IN_NO_SERVER).
STAND_IN = """\
    import json, os, pathlib, sys, time
    pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
    if sys.argv[1:] == ["-f"]:
        if os.environ.get("STAND_IN_FAILS"):
            sys.exit(3)
        seen = {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_LOG_DIRECTORY")}
        pathlib.Path(os.environ["STAND_IN_RECORD"]).write_text(json.dumps(seen | {"pid": os.getpid()}))
        if not os.environ.get("STAND_IN_NEVER_READY"):
            (pipe / "control").write_text("")
        while not (pipe / "quit").exists():
            time.sleep(0.02)
    else:
        command = sys.stdin.read().strip()
        if command == "quit":
            (pipe / "quit").write_text("")
        elif command == "get_server_list" and not os.environ.get("STAND_IN_NO_SERVER"):
            print(4242)
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    """The stand-in control program first on PATH; the file it records the daemon's environment in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / CONTROL
    program.write_text(f"#!{sys.executable}\n" + textwrap.dedent(STAND_IN))
    program.chmod(0o755)
    record = tmp_path / "daemon.json"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_RECORD", str(record))
    return record


def config(*overrides: str):
    return load_config(None, list(overrides))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("overrides, plan, expected", [
    (["run.mps=off"], COLOCATED, False),
    (["run.mps=auto"], COLOCATED, True),  # a server beside the learner
    (["run.mps=auto"], APART, False),  # every role on a GPU of its own: nothing to share
    (["run.mps=auto"], Plan((1,), ((0,), (1,))), False),  # mixed: NCCL to the server apart, untried under MPS
    (["run.mps=auto"], Plan((0, 1), ((0,), (1,))), False),  # two learner ranks: NCCL between them
    (["run.mps=auto"], Plan((0,), ((0,), (0,))), True),  # two servers beside the learner on its one GPU
    (["run.mps=auto"], None, False),  # no GPU
    (["run.mps=auto", "learner.mode=synchronous"], COLOCATED, False),  # its engine and trainer take turns anyway
    (["run.mps=on"], APART, True),
])
def test_which_jobs_get_a_daemon(overrides, plan, expected):
    assert wanted(config(*overrides), plan) is expected


def test_off_is_the_default_and_a_bad_value_is_refused_by_name():
    assert config().run.mps == "off"
    with pytest.raises(ConfigError, match="run.mps"):
        config("run.mps=always")


def test_on_without_a_gpu_is_refused_by_name():
    with pytest.raises(MpsError, match=r"run.mps=on: no GPU is visible"):
        start_mps(config("run.mps=on"), None, Path("/nonexistent"), LOG)


def test_the_roles_become_clients_of_a_daemon_of_the_job_s_own_which_quits_at_the_end(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    daemon = start_mps(config("run.mps=auto"), COLOCATED, tmp_path / "run", LOG)
    assert daemon is not None
    environment = daemon.environment()
    assert environment == {PIPE_ENV: str(daemon.pipe_dir), LOG_ENV: str(tmp_path / "run" / "logs" / "mps")}
    assert len(str(daemon.pipe_dir / "control")) < 108  # a socket's path must fit sun_path
    seen = json.loads(stand_in.read_text())
    # every GPU seen by the daemon: the roles' CUDA_VISIBLE_DEVICES name physical ids, read against its devices
    assert seen["CUDA_VISIBLE_DEVICES"] is None and seen["CUDA_MPS_LOG_DIRECTORY"] == environment[LOG_ENV]
    assert alive(seen["pid"])
    daemon.stop()
    assert daemon.process.returncode == 0  # it quit when told, not killed
    assert not daemon.pipe_dir.exists()


def test_a_server_serving_the_roles_is_logged_and_recorded_once_and_none_at_the_end_is_a_warning(
        stand_in, tmp_path, monkeypatch, caplog):
    daemon = start_mps(config("run.mps=on"), COLOCATED, tmp_path / "run", LOG)
    monkeypatch.setenv("STAND_IN_NO_SERVER", "1")  # no client yet: the daemon runs no server
    with caplog.at_level(logging.INFO):
        daemon.follow(LOG)
        daemon.follow(LOG)  # within ASK_EVERY_S of the first question: not asked again
        assert daemon.serving == [] and not (daemon.log_dir / SERVING_FILE).exists()
        monkeypatch.delenv("STAND_IN_NO_SERVER")
        daemon.follow(LOG)
        assert daemon.serving == []  # asked only every ASK_EVERY_S
        monkeypatch.setattr(mps, "ASK_EVERY_S", 0.0)
        daemon.follow(LOG)
        daemon.follow(LOG, final=True)
    daemon.stop()
    assert daemon.serving == ["4242"] and (daemon.log_dir / SERVING_FILE).read_text() == "4242\n"
    assert caplog.text.count("CUDA MPS: server pid 4242 serves the job's roles") == 1 and "WARNING" not in caplog.text
    caplog.clear()
    monkeypatch.setenv("STAND_IN_NO_SERVER", "1")
    daemon = start_mps(config("run.mps=on"), COLOCATED, tmp_path / "other", LOG)
    with caplog.at_level(logging.INFO):
        daemon.follow(LOG, final=True)
    daemon.stop()
    assert "no MPS server served the job's roles: they shared the GPU in time slices" in caplog.text


def test_auto_goes_on_without_a_daemon_where_none_can_start(stand_in, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no control program
    with caplog.at_level(logging.WARNING):
        assert start_mps(config("run.mps=auto"), COLOCATED, tmp_path / "run", LOG) is None
    assert f"{CONTROL} is not installed" in caplog.text and "time slices" in caplog.text
    with pytest.raises(MpsError, match=f"run.mps: {CONTROL} is not installed"):
        start_mps(config("run.mps=on"), COLOCATED, tmp_path / "run", LOG)


def test_a_daemon_that_exits_or_never_takes_clients_is_refused_in_bounded_time(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_FAILS", "1")
    with pytest.raises(MpsError, match=rf"run.mps: {CONTROL} exited with 3 \(see .*logs/mps\)"):
        start_mps(config("run.mps=on"), COLOCATED, tmp_path / "run", LOG)
    monkeypatch.delenv("STAND_IN_FAILS")
    monkeypatch.setenv("STAND_IN_NEVER_READY", "1")
    monkeypatch.setattr(mps, "START_TIMEOUT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(MpsError, match=r"took no clients within 0.5s"):
        start_mps(config("run.mps=on"), COLOCATED, tmp_path / "run", LOG)
    assert time.monotonic() - started < 10  # the wait, then a quit: under the default wait of 10 s alone
    assert not alive(json.loads(stand_in.read_text())["pid"])  # the daemon that never got ready was stopped


def test_the_daemon_dies_with_a_launcher_killed_outright(stand_in, tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import logging, time
        from asyncrl.config import load_config
        from asyncrl.placement import Plan
        from launch.mps import start_mps
        start_mps(load_config(None, ["run.mps=on"]), Plan((0,), ((0,),)), __import__("pathlib").Path({str(tmp_path)!r}),
                  logging.getLogger())
        print("started", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[3])
    assert launcher.stdout.readline().strip() == "started"
    daemon_pid = json.loads(stand_in.read_text())["pid"]
    assert alive(daemon_pid)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while alive(daemon_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(daemon_pid)


def test_asyncrl_run_gives_both_roles_the_daemon_and_stops_it_after_them(tmp_path, monkeypatch):
    import argparse

    from launch.commands import run

    events: list[str] = []

    class StandInDaemon:
        def environment(self):
            return {PIPE_ENV: "/tmp/asyncrl-mps-x", LOG_ENV: "/run/logs/mps"}

        def follow(self, log, final=False):
            if final:
                events.append("asked at the end")

        def stop(self):
            events.append("daemon stopped")

    def launch(command, log_path, environment, stderr_to_console=False):
        role = command[3]
        events.append(f"{role} started with {environment.get(PIPE_ENV)}")
        return subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)

    class NoStop:  # the real one would take this process's SIGINT and SIGTERM for good
        requested = False

    monkeypatch.setattr(run, "start", lambda args, role: (load_config(None, args.overrides), LOG))
    monkeypatch.setattr(run, "StopSignal", NoStop)
    monkeypatch.setattr(run, "ended_normally", lambda: None)
    monkeypatch.setattr(run, "check_input_files", lambda config: None)
    monkeypatch.setattr(run, "place_local_job", lambda config, log, automatic: COLOCATED)
    monkeypatch.setattr(run, "start_mps", lambda config, plan, run_dir, log: StandInDaemon())
    monkeypatch.setattr(run, "check_model", lambda config: None)
    monkeypatch.setattr(run, "_launch", launch)
    monkeypatch.setattr(run, "_stop", lambda process, own_stop_s=0.0: events.append("role stopped"))
    args = argparse.Namespace(config=None, overrides=[f"run.root_dir={tmp_path}", "run.name=job", "run.mps=on"])
    assert run.main(args) == 0
    assert events == ["learner started with /tmp/asyncrl-mps-x", "rollout started with /tmp/asyncrl-mps-x",
                      "role stopped", "role stopped", "asked at the end", "daemon stopped"]
