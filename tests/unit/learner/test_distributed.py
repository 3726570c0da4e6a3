"""How learner ranks meet (`learner.distributed`): one rank needs no port at all, and the ranks a process spawns meet
at a store that process bound before spawning them, so no other job on the host can take the port in between."""

import os

import torch.distributed as dist

from asyncrl.net import LOOPBACK, port_is_free
from learner.distributed import init_single_rank_world, local_rank_environment, spawner_store


def test_a_spawners_store_holds_its_port_from_the_moment_it_is_made():
    store = spawner_store(2)
    assert store.port > 0
    assert not port_is_free(LOOPBACK, store.port)  # bound now, not picked for a rank to bind later


def test_the_ranks_of_a_spawner_connect_to_its_store_as_clients():
    assert local_rank_environment(1, 2, 4567) == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": LOOPBACK, "MASTER_PORT": "4567",
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # rank 0 too: the spawner serves the store
    }


def test_one_rank_opens_its_world_without_a_rendezvous_port(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)
    for key, leftover in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(key, leftover)  # a launcher's variables do not make a single-rank tool wait for a peer
    assert not dist.is_initialized()
    try:
        world = init_single_rank_world("cpu")
        assert (world.rank, world.size, dist.get_world_size()) == (0, 1, 1)
        assert "MASTER_PORT" not in os.environ  # env:// would have needed it
    finally:
        dist.destroy_process_group()
