"""NCCL settings for the weight-transfer peers: set before any communicator, never over the user's own."""

import json
import os
import subprocess
import sys

import pytest

from asyncrl.exit_codes import CANNOT_START
from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment

NCCL_VARIABLES = ("NCCL_CUMEM_ENABLE", "NCCL_SOCKET_IFNAME")
SUBPROCESS_TIMEOUT_S = 120  # a Python that imports vLLM, on a loaded box


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



SERVE_ONE_UNTIL_BUILT = """
import json, os, sys, types
from asyncrl.config import load_config
from rollout_servers import server_process
from rollout_servers.learner_wait import Endpoints

class ReportsItsEnvironment:  # stands in for the server, built where vLLM's engine would start next
    def __init__(self, *args):
        print(json.dumps({name: os.environ.get(name) for name in sys.argv[2:]}), flush=True)
        raise RuntimeError("built: stop here")

sys.modules["rollout_servers.server"] = types.SimpleNamespace(RolloutServer=ReportsItsEnvironment)  # what serve_one imports
config = load_config(None, ["rollout.weight_sync.host=10.1.2.3"])
server_process.serve_one(config, 0, Endpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), sys.argv[1])
"""


def test_every_rollout_server_process_sets_them_before_its_engine_starts(tmp_path):
    """Each server process sets them itself (`serve_one`, under `asyncrl rollout` and `asyncrl launch` alike): under
    Ray no rollout command runs, and vLLM 0.24 no longer sets NCCL_CUMEM_ENABLE, so a server left at NCCL's default
    (cuMem on) failed every broadcast from a learner with it off."""
    environment = {name: value for name, value in os.environ.items() if name not in NCCL_VARIABLES}
    done = subprocess.run([sys.executable, "-c", SERVE_ONE_UNTIL_BUILT, str(tmp_path), *NCCL_VARIABLES], env=environment,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == CANNOT_START, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"NCCL_CUMEM_ENABLE": "0", "NCCL_SOCKET_IFNAME": None}
