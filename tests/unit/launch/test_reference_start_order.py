"""A rank of the synchronous reference starts its engine before its own process group: on a GPU the group opens
CUDA in the process, after which vLLM can no longer fork its engine core and spawns it instead (importing torch and
vLLM again: 21.5 s against 8.7 s for a tiny engine's start on an H200). The engine's processes must not see the
ranks' store either, which the rank joins after. Stand-ins for the engine and the group record the order."""

import os
from contextlib import contextmanager

import pytest

import launch.commands.reference
import learner.main
import rollout_servers.reference_sampler
from asyncrl.config import load_config
from asyncrl.exit_codes import INTERRUPTED
from launch.commands.reference import _run_rank

RANK_STORE_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("rank, ranks", [(0, 1), (1, 2)])
def test_the_engine_starts_before_the_process_group_and_without_the_ranks_store(monkeypatch, tmp_path, rank, ranks):
    for key in RANK_STORE_KEYS:
        monkeypatch.setenv(key, "")  # noted, so that the rank's own values go with the test
        monkeypatch.delenv(key)
    seen: list[tuple[str, dict[str, str]]] = []

    class Sampler:
        @classmethod
        def start(cls, config, gpus, backend, started_rank, started_ranks):
            seen.append(("engine", {key: os.environ[key] for key in RANK_STORE_KEYS if key in os.environ}))
            assert (started_rank, started_ranks) == (rank, ranks)
            return cls()

        def close(self) -> None:
            seen.append(("engine closed", {}))

    @contextmanager
    def process_group(config):
        seen.append(("group", {key: os.environ[key] for key in RANK_STORE_KEYS if key in os.environ}))
        raise KeyboardInterrupt  # stop the rank here: what follows needs a real policy
        yield

    monkeypatch.setattr(rollout_servers.reference_sampler, "ReferenceSampler", Sampler)
    monkeypatch.setattr(learner.main, "learner_world", process_group)
    monkeypatch.setattr(launch.commands.reference, "setup_logging", lambda *args: None)  # root logger stays pytest's
    code = _run_rank(load_config(None, ["metrics.wandb_mode=disabled"]), tmp_path, None, False, "reference", rank,
                     ranks, store_port=29511)

    assert code == INTERRUPTED
    assert [step for step, _ in seen] == ["engine", "group", "engine closed"]
    assert seen[0][1] == {}, "the engine's processes would meet at the ranks' store"
    group_environment = seen[1][1]
    if ranks > 1:
        assert (group_environment["RANK"], group_environment["WORLD_SIZE"], group_environment["MASTER_PORT"]) == (
            str(rank), str(ranks), "29511")
    else:
        assert group_environment == {}
