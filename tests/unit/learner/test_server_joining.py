"""Before its first step the learner waits for the servers that start their engines at once (one per GPU that servers
share); a server that joins later is caught up to the latest weights before it samples again. Fake servers on real
ZeroMQ sockets and a real gloo group."""

import logging
import threading

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.placement import servers_starting_at_once
from learner.services.connections import LearnerConnections
from tests.unit.learner.test_sync_coordinator import TIMEOUT_S, FakeServer, coordinator, weights


@pytest.mark.parametrize("gpus, tensor_parallel, starting", [
    ("[]", 1, 3),  # no lists (a CPU box, servers started apart): every server
    ("[0,1,2]", 1, 3),  # a GPU each
    ("[0,0,0]", 1, 1),  # all on one GPU: they start in turn
    ("[0,0,1]", 1, 2),
    ("[0,1,1,2,3,4]", 2, 2),  # tensor-parallel: the first two linked by GPU 1
])
def test_servers_starting_at_once_are_one_per_set_of_shared_gpus(gpus, tensor_parallel, starting):
    config = load_config(None, ["rollout.num_servers=3", f"rollout.gpus={gpus}",
                                f"rollout.engine.tensor_parallel_size={tensor_parallel}"])
    assert servers_starting_at_once(config) == starting


def connections_of(coord, overrides: list[str]) -> LearnerConnections:
    # only the config and the coordinator take part in joining and catching up
    config = load_config(None, overrides)
    return LearnerConnections(config, run_dir=None, consumer=None, coordinator=coord, metrics=None, buffer_process=None)


def test_servers_sharing_a_gpu_the_learner_starts_with_the_first_and_catches_the_later_one_up():
    coord = coordinator()
    first, later = FakeServer("s0", coord.address), FakeServer("s1", coord.address)
    # a connect timeout far beyond the test's: waiting for both servers would not end within it
    connections = connections_of(coord, ["rollout.num_servers=2", "rollout.gpus=[0,0]",
                                         "rollout.connect_timeout_s=3600"])
    first.start()
    try:
        waiting = threading.Thread(target=connections.wait_for_servers, daemon=True)
        waiting.start()
        waiting.join(timeout=TIMEOUT_S)
        assert not waiting.is_alive(), "the learner waited for the server starting after the first"
        assert coord.live_members() == ["s0"]

        report = connections.sync_weights(1, weights(2.0))  # the first round reaches the server that joined
        assert report.succeeded == ["s0"] and sorted(first.received) == [1]

        later.start()
        assert coord.wait_for_members(2, timeout_s=TIMEOUT_S) == ["s0", "s1"]
        assert coord.lagging_members(1) == ["s1"]
        connections.catch_up_servers()
        assert sorted(later.received) == [1], "the later server got the latest weights"
        assert all(torch.equal(later.received[1][name], tensor) for name, tensor in weights(2.0))
        assert coord.lagging_members(1) == []
    finally:
        for server in (first, later):
            server.stop.set()
        coord.close()


def test_servers_on_gpus_of_their_own_are_all_waited_for_up_to_the_timeout(caplog):
    coord = coordinator()
    first = FakeServer("s0", coord.address)
    first.start()
    caplog.set_level(logging.INFO, logger="learner.services.connections")
    try:
        assert coord.wait_for_members(1, timeout_s=TIMEOUT_S) == ["s0"]
        connections_of(coord, ["rollout.num_servers=2", "rollout.gpus=[0,1]",
                               "rollout.connect_timeout_s=1"]).wait_for_servers()
        assert coord.live_members() == ["s0"]
        assert "1 of the 2 servers starting at once joined within 1s" in caplog.text  # it waited for the second
    finally:
        first.stop.set()
        coord.close()
