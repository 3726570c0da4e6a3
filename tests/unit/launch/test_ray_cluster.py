"""The Ray launcher's pieces that need no cluster: role command lines, bundles, the config section,
CURVE key shipping, and the reaper that stops a role's processes once its actor is gone."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.ray_launch import RayRoleConfig
from asyncrl.exit_codes import CANNOT_START
from launch.ray_cluster.launcher import Launch, LaunchError, Outcome, RoleCannotStart, RoleHandle
from launch.ray_cluster.reaper import POLL_S as REAPER_POLL_S, group_alive, process_alive
from launch.ray_cluster.roles import RunArgs, buffer_role, learner_role, rollout_role
from waiting import wait_until

RUN_DIR = Path("/shared/runs/demo")
REAP_DEADLINE_S = 10.0


def run_args() -> RunArgs:
    return RunArgs("configs/quickstart.yaml", ["learner.total_steps=5"], RUN_DIR)


def test_every_role_gets_the_config_overrides_and_run_directory():
    common = ["--config", "configs/quickstart.yaml", "learner.total_steps=5", "run.root_dir=/shared/runs", "run.name=demo"]
    buffer = buffer_role(run_args(), RUN_DIR / "buffer", "10.0.0.1", 0)
    assert buffer.args == ["buffer", *common, f"buffer.dir={RUN_DIR / 'buffer'}", "buffer.bind_host=10.0.0.1", "buffer.port=0"]
    assert buffer.ready_file == str(RUN_DIR / "buffer" / "endpoint")
    server = rollout_role(run_args(), 3, "tcp://10.0.0.1:5000", "tcp://10.0.0.2:6000")
    assert server.name == "rollout-3" and server.module == "launch.ray_cluster.serve_rollout"
    assert server.args == ["--index", "3", *common, "buffer.address=tcp://10.0.0.1:5000",
                           "rollout.weight_sync.control_address=tcp://10.0.0.2:6000"]
    assert server.error_file == str(RUN_DIR / "logs" / "rollout3.error")  # where `serve_one` leaves what it died of


def test_learner_ranks_form_one_world_and_rank_0_serves_on_its_node():
    config = load_config(None, ["learner.nproc=4", "rollout.weight_sync.control_bind=tcp://127.0.0.1:7000"])
    rank0 = learner_role(run_args(), config, 0, ("10.0.0.2", 29500), "tcp://10.0.0.1:5000", "10.0.0.2")
    rank3 = learner_role(run_args(), config, 3, ("10.0.0.2", 29500), "tcp://10.0.0.1:5000", "10.0.0.3")
    assert rank3.env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}
    assert "rollout.weight_sync.control_bind=tcp://10.0.0.2:7000" in rank0.args  # the configured port, its node's host
    assert "rollout.weight_sync.host=10.0.0.2" in rank0.args and "buffer.address=tcp://10.0.0.1:5000" in rank0.args
    assert rank0.ready_file == str(RUN_DIR / "endpoints.json") and rank3.ready_file == ""


def test_bundles_leave_out_zero_amounts():
    from launch.ray_cluster.placement import bundle

    assert bundle(RayRoleConfig(num_cpus=2, num_gpus=0, resources={"rollout_node": 1})) == {"CPU": 2, "rollout_node": 1}
    assert bundle(RayRoleConfig(num_cpus=0, num_gpus=1)) == {"GPU": 1}


def test_ray_section_loads_resources_and_checks_rollout_gpus():
    config = load_config(None, ["ray.rollout.resources={rollout_node: 1}", "ray.learner.num_gpus=1"])
    assert config.ray.rollout.resources == {"rollout_node": 1.0} and config.ray.learner.num_gpus == 1.0
    with pytest.raises(ConfigError, match="ray.rollout.num_gpus"):
        load_config(None, ["ray.rollout.num_gpus=2"])  # tensor_parallel_size is 1
    with pytest.raises(ConfigError, match="ray.learner_strategy"):
        load_config(None, ["ray.learner_strategy=RANDOM"])


def test_curve_keys_are_generated_once_per_run_and_written_privately(tmp_path):
    from launch.ray_cluster.actor import write_keys
    from launch.ray_cluster.launcher import curve_keys

    config = load_config(None, [])
    keys = curve_keys(config, tmp_path)
    assert {"server.key", "server.key_secret", "client.key", "client.key_secret"} <= set(keys)
    assert any(name.startswith("authorized_clients/") for name in keys)
    assert curve_keys(config, tmp_path) == keys  # the same pair for every role and every restart
    local = Path(write_keys(keys))
    assert stat.S_IMODE((local / "server.key_secret").stat().st_mode) == 0o600
    assert (local / "client.key").read_bytes() == keys["client.key"]


def test_an_external_buffer_without_keys_is_refused_naming_the_key(tmp_path):
    from launch.ray_cluster.launcher import LaunchError, curve_keys

    # the control socket binds the learner's node address: no keys, no launch
    with pytest.raises(LaunchError, match=r"buffer\.curve_dir"):
        curve_keys(load_config(None, ["buffer.address=tcp://10.0.0.1:5000"]), tmp_path)


def test_reaper_stops_the_whole_group_once_its_owner_is_gone():
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # a role with a child of its own, in a session of its own (as RoleProcess starts it)
    role = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    subprocess.run([sys.executable, "-m", "launch.ray_cluster.reaper", str(owner.pid), str(role.pid), "2"], check=True)
    try:
        time.sleep(2 * REAPER_POLL_S)  # the behaviour under test: two of the reaper's checks leave the role alone
        assert group_alive(role.pid)
        owner.kill()
        owner.wait()
        # role.poll() reaps our own child, so that only real survivors keep the group alive
        wait_until(lambda: role.poll() is not None and not group_alive(role.pid), REAP_DEADLINE_S,
                   "the role's group stopped by the reaper", poll_s=0.1)
        assert role.returncode == -signal.SIGTERM
        assert not process_alive(owner.pid)
    finally:
        owner.kill()
        if group_alive(role.pid):
            os.killpg(role.pid, signal.SIGKILL)


class EndedRoles(Launch):
    """A launch whose roles have all exited with `code` (no cluster: the Ray calls are stood in)."""

    def __init__(self, code: int) -> None:
        super().__init__(load_config(None, []), run_args(), {})
        self.code = code
        self.discarded = 0

    def outcome(self, handle: RoleHandle) -> Outcome:
        return Outcome(self.code, f"exited with code {self.code}")

    def call(self, ref):
        return ref  # what the stand-in actor's `.remote` answered

    def discard(self, actor) -> None:
        self.discarded += 1


def server_handle(error: str | None = None) -> RoleHandle:
    """Server 0's handle, its actor a stand-in whose node holds `error` in the server's error file (None: no file)."""
    handle = RoleHandle("rollout-0", group=None, bundle=0, resources=RayRoleConfig())
    handle.spec = rollout_role(run_args(), 0, "tcp://10.0.0.1:5000", "tcp://10.0.0.2:6000")
    files = {} if error is None else {handle.spec.error_file: error + "\n"}
    handle.actor = SimpleNamespace(read_file=SimpleNamespace(remote=files.get))
    return handle


def test_a_server_that_cannot_start_from_its_config_ends_the_launch_instead_of_restarting():
    launch, handle = EndedRoles(CANNOT_START), server_handle()
    with pytest.raises(LaunchError, match="rollout-0 cannot start from this config or install .*rollout-0.out"):
        launch.keep_alive(handle)
    assert (launch.discarded, handle.restart_at) == (0, None)


def test_a_server_that_crashed_is_restarted_with_back_off():
    launch, handle = EndedRoles(1), server_handle()
    before = time.monotonic()
    launch.keep_alive(handle)
    after, first_delay_s = time.monotonic(), launch.config.rollout.restart_backoff_s  # the first death in a row
    assert launch.discarded == 1 and before + first_delay_s <= handle.restart_at <= after + first_delay_s


def die_after(launch: EndedRoles, handle: RoleHandle, ran_s: float) -> None:
    """The handle's role, (re)started `ran_s` ago, is found dead."""
    handle.started_at, handle.restart_at = time.monotonic() - ran_s, None
    launch.keep_alive(handle)


def test_a_server_that_dies_of_the_same_error_twice_in_a_row_ends_the_launch_naming_it():
    launch, handle = EndedRoles(1), server_handle(error="RuntimeError: Unsupported CPU attention configuration: head_dim=16")
    die_after(launch, handle, ran_s=1.0)
    assert launch.discarded == 1
    with pytest.raises(RoleCannotStart, match=r"rollout-0 cannot run this config or install \(not restarted again\): "
                       r"the same error ended 2 starts in a row, .*: RuntimeError: Unsupported CPU attention "
                       r"configuration: head_dim=16; see .*rollout-0.out") as raised:
        die_after(launch, handle, ran_s=1.0)
    assert raised.value.exit_code == CANNOT_START


def test_a_server_that_keeps_dying_soon_after_its_start_fails_the_launch_naming_its_log():
    launch, handle = EndedRoles(1), server_handle()
    launch.settings.max_restarts = 2
    die_after(launch, handle, ran_s=1.0)
    die_after(launch, handle, ran_s=1.0)
    with pytest.raises(LaunchError, match=r"rollout-0 keeps dying: death 3 in a row .*\(exited with code 1; "
                                          r"ray.max_restarts=2\); see .*rollout-0.out"):
        die_after(launch, handle, ran_s=1.0)


def test_a_server_that_ran_healthy_before_it_died_starts_its_count_afresh():
    launch, handle = EndedRoles(1), server_handle()
    launch.settings.max_restarts = 2
    for ran_s in (1.0, 1.0, launch.config.rollout.healthy_after_s, 1.0):
        die_after(launch, handle, ran_s)
    assert handle.deaths.in_a_row == 2 and launch.discarded == 4
