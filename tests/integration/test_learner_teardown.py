"""How a learner rank leaves its process group (`learner.main.learner_world`), on two gloo ranks: after a normal end
the ranks leave together, so that no rank closes its connections under a peer that is still busy (rank 0 telling
the servers the job ended); after an error a rank leaves at once, without waiting for a peer that may never come."""

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch.distributed

from asyncrl.config import load_config
from learner.distributed import local_rank_environment, spawner_store

pytestmark = pytest.mark.slow

BUSY_S = 3.0  # how long the busy rank works inside the group before leaving it
JOIN_TIMEOUT_S = 120


def rank_main(rank: int, port: int, out: str, busy_rank: int, fails: bool) -> None:
    """Join a two-rank world; `busy_rank` works BUSY_S inside it; with `fails`, each rank fails once its work is done.
    Writes when its work ended and when it had left the group."""
    from learner.main import learner_world

    os.environ.update(local_rank_environment(rank, 2, port))
    times = {}
    try:
        with learner_world(load_config(None, ["learner.device=cpu"])):
            # both ranks wholly in the group first: a rank failing at once would otherwise close its connections under
            # a peer still connecting (gloo's "Connection closed by peer" on a busy box), which never reaches its work
            torch.distributed.barrier()
            if rank == busy_rank:
                time.sleep(BUSY_S)
            times["work_done"] = time.time()
            Path(out, f"rank{rank}.json").write_text(json.dumps(times))
            if fails:
                raise RuntimeError("a failed step")
    except RuntimeError:
        pass
    times["left"] = time.time()
    Path(out, f"rank{rank}.json").write_text(json.dumps(times))


def run_two_ranks(tmp_path: Path, busy_rank: int, fails: bool) -> dict[int, dict[str, float]]:
    context = multiprocessing.get_context("spawn")
    store = spawner_store(2)
    ranks = [context.Process(target=rank_main, args=(rank, store.port, str(tmp_path), busy_rank, fails)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
    return {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def test_after_a_normal_end_a_rank_leaves_only_once_its_busy_peer_is_done(tmp_path):
    times = run_two_ranks(tmp_path, busy_rank=0, fails=False)
    assert times[1]["work_done"] < times[0]["work_done"] - BUSY_S / 2  # rank 1 was ready long before rank 0
    assert times[1]["left"] >= times[0]["work_done"]  # ...and waited for it


def test_after_an_error_a_rank_leaves_without_waiting_for_its_peer(tmp_path):
    times = run_two_ranks(tmp_path, busy_rank=1, fails=True)
    assert times[0]["left"] < times[1]["work_done"] - BUSY_S / 2
