"""Every rank of the synchronous reference starts its engine before its process group: on a GPU the group opens CUDA
in the process, after which vLLM can no longer fork its engine core and spawns it instead (importing torch and vLLM
again: 21.5 s against 8.7 s for a tiny engine's start on an H200). So whether the engine shares the rank's GPU, has
GPUs of its own, or ranks are several (each engine on its rank's GPU; its processes see only that GPU, and the rank
opens CUDA after them with its own view: tests/unit/rollout_servers/test_engine_gpu_view.py). The engine's processes
never see the ranks' store, and the rank's process keeps none of its variables after the join. Stand-ins for the
engine and the group record the order."""

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
STORE_PORT = 29511


@pytest.mark.parametrize("rank, ranks, apart", [
    (0, 1, False),  # one GPU, shared
    (0, 1, True),  # the engine on a GPU of its own
    (1, 2, False),  # colocated ranks: each engine on its rank's GPU of several
])
def test_the_engine_starts_before_the_process_group_and_never_sees_the_ranks_store(monkeypatch, tmp_path, rank, ranks,
                                                                                    apart):
    for key in RANK_STORE_KEYS:
        monkeypatch.setenv(key, "")  # noted, so that the rank's own values go with the test
        monkeypatch.delenv(key)
    seen: list[tuple[str, dict[str, str]]] = []

    def rank_store() -> dict[str, str]:
        return {key: os.environ[key] for key in RANK_STORE_KEYS if key in os.environ}

    class Sampler:
        @classmethod
        def start(cls, config, gpus, backend, started_rank, started_ranks):
            seen.append(("engine", rank_store()))
            assert (started_rank, started_ranks) == (rank, ranks)
            return cls()

        def close(self) -> None:
            seen.append(("engine closed", {}))

    @contextmanager
    def process_group(config):
        seen.append(("group", rank_store()))
        try:
            yield
        finally:
            seen.append(("group left", {}))

    def stop_before_the_policy(config, world):
        raise KeyboardInterrupt  # what follows needs a real policy

    monkeypatch.setattr(rollout_servers.reference_sampler, "ReferenceSampler", Sampler)
    monkeypatch.setattr(learner.main, "learner_world", process_group)
    monkeypatch.setattr("learner.reference_trainer.ReferenceTrainer.load", stop_before_the_policy)
    monkeypatch.setattr(launch.commands.reference, "setup_logging", lambda *args: None)  # root logger stays pytest's
    code = _run_rank(load_config(None, ["metrics.wandb_mode=disabled"]), tmp_path, None, apart, "reference", rank, ranks,
                     store_port=STORE_PORT)

    assert code == INTERRUPTED
    assert [step for step, _ in seen[:2]] == ["engine", "group"]
    assert sorted(step for step, _ in seen[2:]) == ["engine closed", "group left"]
    environment = dict(seen[:2])
    assert environment["engine"] == {}, "the engine's processes would meet at the ranks' store"
    if ranks > 1:
        store = environment["group"]
        assert (store["RANK"], store["WORLD_SIZE"], store["MASTER_PORT"]) == (str(rank), str(ranks), str(STORE_PORT))
    else:
        assert environment["group"] == {}
    assert rank_store() == {}  # the join's variables are gone: no process started later meets at the store
