"""NCCL settings for the weight-transfer peers: set before any communicator, never over the user's own."""

import os

import pytest

from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment

NCCL_VARIABLES = ("NCCL_CUMEM_ENABLE", "NCCL_SOCKET_IFNAME")


@pytest.fixture(autouse=True)
def clean_nccl_environment():
    """Start without the variables; afterwards put back exactly what was there (the code writes os.environ)."""
    saved = {name: os.environ.pop(name, None) for name in NCCL_VARIABLES}
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def test_loopback_group_pins_the_loopback_interface_and_disables_cumem():
    applied = prepare_nccl_environment("127.0.0.1")
    assert applied == {"NCCL_CUMEM_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo"}
    assert prepare_nccl_environment("localhost") == {}  # already set: nothing changes the second time


def test_remote_group_leaves_the_interface_to_nccl():
    assert prepare_nccl_environment("10.1.2.3") == {"NCCL_CUMEM_ENABLE": "0"}


def test_values_the_user_exported_win(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    assert prepare_nccl_environment("127.0.0.1") == {}


def test_unresolvable_host_is_not_treated_as_loopback():
    assert "NCCL_SOCKET_IFNAME" not in prepare_nccl_environment("no-such-host.invalid")


def test_a_ray_rollout_server_sets_them_before_its_engine_starts(monkeypatch):
    """Under `asyncrl launch` no rollout command runs: the server's own entry point must set them, or its vLLM
    workers (cuMem on) and the learner (cuMem off) disagree and every broadcast fails."""
    from asyncrl.launch_ray import serve_rollout
    from rollout_servers import supervisor

    seen = {}
    monkeypatch.setattr(supervisor, "serve_one", lambda *args: seen.update(os.environ))
    assert serve_rollout.main(["--index", "0", "rollout.weight_sync.host=10.1.2.3"]) == 0
    assert seen["NCCL_CUMEM_ENABLE"] == "0" and "NCCL_SOCKET_IFNAME" not in seen
