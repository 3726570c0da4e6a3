"""CUDA MPS on a GPU (`run.mps`, launch/mps.py) with NVIDIA's own control program: a learner-like process and a
server-like one, both clients of the job's daemon, pass weights through CUDA IPC as they do without it, the daemon
runs a server for them, and it quits when told. The CPU tests (tests/unit/launch/test_mps.py) stand in for the
program; this is where the real one answers."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.placement import Plan
from launch.mps import CONTROL, SERVING_FILE, start_mps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(shutil.which(CONTROL) is None, reason=f"needs {CONTROL}")]

SPAWN = multiprocessing.get_context("spawn")
WAIT_S = 120  # no child may make the test hang


def learner_side(handles, results) -> None:
    """Write weights into a shared buffer, hand its handle over, and keep it alive until the reader is done."""
    from asyncrl.weight_transfer import update_info_for
    from asyncrl.weight_transfer.ipc import SharedWeights

    weights = [("w", torch.arange(4096, dtype=torch.float32, device="cuda").reshape(64, 64))]
    shared = SharedWeights()
    shared.reserve(weights)
    shared.write(weights)
    handles.put((shared.handle.as_dict(), update_info_for(weights)))
    results.get(timeout=WAIT_S)  # the reader's answer, passed back once it has read


def server_side(handles, results, answers) -> None:
    from asyncrl.weight_transfer import parse_update_info
    from asyncrl.weight_transfer.ipc import SharedWeightsReader

    handle, update_info = handles.get(timeout=WAIT_S)
    reader = SharedWeightsReader.open(handle, torch.device("cuda", 0))
    # plain lists: a tensor would go by shared memory, fetched from this process after it has exited
    read = {name: view.cpu().tolist() for name, view in reader.tensors(parse_update_info(update_info))}
    reader.synchronize()
    answers.put(read)
    results.put("done")


def test_two_clients_of_the_job_s_daemon_pass_weights_by_cuda_ipc(tmp_path, monkeypatch):
    daemon = start_mps(load_config(None, ["run.mps=on"]), Plan((0,), ((0,),)), tmp_path, logging.getLogger("mps"))
    assert daemon is not None
    try:
        for key, value in daemon.environment().items():
            monkeypatch.setenv(key, value)  # spawned children inherit it: their CUDA contexts become clients
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
        handles, results, answers = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
        learner = SPAWN.Process(target=learner_side, args=(handles, results))
        server = SPAWN.Process(target=server_side, args=(handles, results, answers))
        learner.start()
        server.start()
        read = answers.get(timeout=WAIT_S)
        servers = subprocess.run([CONTROL], input="get_server_list\n", text=True, capture_output=True,
                                 env=os.environ | daemon.environment(), timeout=30).stdout
        daemon.follow(logging.getLogger("mps"), final=True)  # what `asyncrl run` asks, then records for the job
        for process in (learner, server):
            process.join(WAIT_S)
        assert read["w"] == torch.arange(4096, dtype=torch.float32).reshape(64, 64).tolist()
        assert [learner.exitcode, server.exitcode] == [0, 0]
        assert servers.strip(), "the daemon runs no MPS server: the processes were not its clients"
        assert daemon.serving == servers.split() and (daemon.log_dir / SERVING_FILE).is_file()
    finally:
        daemon.stop()
    assert daemon.process.returncode == 0
    assert not Path(daemon.pipe_dir).exists()
