"""Same-GPU weight transfer through CUDA IPC between two processes: the server maps the learner's buffer once
and reads every later round's weights through that mapping; a server on another GPU is refused."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from asyncrl.weight_transfer import WeightTransferError, parse_update_info, update_info_for
from asyncrl.weight_transfer.ipc import OTHER_GPU, SharedWeights, SharedWeightsReader

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPAWN = multiprocessing.get_context("spawn")
WAIT_S = 120  # no child may make the test hang
ROUNDS = 3


def weights(round_: int) -> list[tuple[str, torch.Tensor]]:
    """bf16 and fp32 tensors of odd sizes whose values change every round (a transposed view among them)."""
    generator = torch.Generator().manual_seed(round_)
    return [("embed.weight", torch.randn(151, 7, generator=generator).to(torch.bfloat16).cuda()),
            ("proj.weight", torch.randn(33, 17, generator=generator).cuda().t()),
            ("norm.weight", torch.randn(4864, generator=generator).to(torch.bfloat16).cuda())]


def server(handle: dict, update_info: dict, requests, answers) -> None:
    """Map the buffer once; on each request read every tensor and send back a CPU copy of what it read."""
    torch.cuda.set_device(0)
    reader = SharedWeightsReader.open(handle, torch.device("cuda", 0))
    metas = parse_update_info(update_info)
    while requests.get(timeout=WAIT_S) is not None:
        read = {name: view.cpu() for name, view in reader.tensors(metas)}
        reader.synchronize()
        answers.put(read)
    try:
        SharedWeightsReader.open(handle | {"gpu_uuid": "GPU-elsewhere"}, torch.device("cuda", 0))
        answers.put("mapped a buffer of another GPU")
    except WeightTransferError as error:
        answers.put(str(error))


def test_rounds_written_after_the_mapping_are_read_through_it():
    shared = SharedWeights()
    assert shared.reserve(weights(0))
    assert not shared.reserve(weights(1))  # the same sizes: the buffer, and so the handle, stays
    requests, answers = SPAWN.Queue(), SPAWN.Queue()
    child = SPAWN.Process(target=server, args=(shared.handle.as_dict(), update_info_for(weights(0)), requests, answers))
    child.start()
    try:
        for round_ in range(ROUNDS):
            shared.write(weights(round_))
            requests.put(round_)
            read = answers.get(timeout=WAIT_S)
            assert all(torch.equal(read[name], tensor.cpu()) for name, tensor in weights(round_))
        requests.put(None)
        assert OTHER_GPU in answers.get(timeout=WAIT_S)
        child.join(WAIT_S)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        shared.close()
