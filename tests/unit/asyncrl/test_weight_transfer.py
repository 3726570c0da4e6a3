"""The torch-only weight-transfer group: broadcast round trip, deadlines, the update-info protocol, tied heads, and
the layout of the shared buffer of same-GPU (CUDA IPC) transfers."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from asyncrl.config.sections import TinyModelConfig
from demo.tiny.model import build_tiny_model
from demo.tiny.tokenizer import build_char_tokenizer
from asyncrl.weight_transfer import (
    TRAINER_RANK,
    GroupAddress,
    WeightTransferError,
    parse_update_info,
    update_info_for,
    weights_for_transfer,
)
from asyncrl.net import port_is_free
from asyncrl.weight_transfer.backends import GLOO
from asyncrl.weight_transfer.ipc import ALIGN_BYTES, SharedWeightsReader, byte_layout, pack_into
from asyncrl.weight_transfer.sender import stage_for_transfer

DEADLINE_S = 2.0  # rendezvous deadline of the failure tests
POLL_SLACK_S = 0.5  # the rendezvous re-checks every 0.2 s
WORKER_RANK = 1


def address(timeout_s: float = DEADLINE_S) -> GroupAddress:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return GroupAddress("127.0.0.1", port, world_size=2, backend="gloo", timeout_s=timeout_s)


def receive_all(where: GroupAddress, update_info: dict) -> list[torch.Tensor]:
    group = GLOO.join(where, WORKER_RANK)
    received = []
    for meta in parse_update_info(update_info):
        buffer = torch.empty(meta.shape, dtype=meta.dtype)
        group.broadcast(buffer)
        received.append(buffer)
    group.close()
    return received


def test_sender_broadcasts_every_tensor_in_order():
    where = address(timeout_s=30.0)
    named = [
        ("a.weight", torch.randn(3, 5)),
        ("b.bias", torch.arange(7, dtype=torch.bfloat16)),
        ("c.view", torch.randn(4, 6).t()),  # non-contiguous: sent as a contiguous copy
    ]
    with ThreadPoolExecutor(max_workers=1) as pool:
        receiving = pool.submit(receive_all, where, update_info_for(named))
        sender = GLOO.sending_end()
        sender.connect(where)
        sender.send(sender.stage(named))
        received = receiving.result()
    sender.close()
    assert len(received) == len(named)
    for (_, sent), got in zip(named, received):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_worker_without_trainer_fails_within_its_deadline():
    started = time.perf_counter()
    with pytest.raises(WeightTransferError, match="waiting for the trainer's store"):
        GLOO.join(address(), WORKER_RANK)
    assert time.perf_counter() - started < DEADLINE_S + POLL_SLACK_S


def test_trainer_without_workers_fails_within_its_deadline():
    started = time.perf_counter()
    with pytest.raises(WeightTransferError, match="waiting for all rollout workers"):
        GLOO.join(address(), TRAINER_RANK)
    assert time.perf_counter() - started < DEADLINE_S + POLL_SLACK_S


def test_the_trainers_store_listens_on_the_groups_host_alone():
    where = address()
    with ThreadPoolExecutor(max_workers=1) as pool:
        joining = pool.submit(GLOO.join, where, WORKER_RANK)
        sender = GLOO.sending_end()
        sender.connect(where)
        listening = {tuple(c.laddr) for c in psutil.Process().net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == where.port}
        joining.result().close()
    sender.close()
    assert listening == {("127.0.0.1", where.port)}  # not every interface ("::" or "0.0.0.0")


def test_the_port_of_a_planned_group_is_held_from_the_moment_it_is_named():
    sender = GLOO.sending_end()
    where = sender.address("127.0.0.1", 0, world_size=2, timeout_s=30.0)
    assert where.port > 0 and not port_is_free("127.0.0.1", where.port), "another process could take it"
    named = [("a.weight", torch.randn(3, 5))]
    with ThreadPoolExecutor(max_workers=1) as pool:
        receiving = pool.submit(receive_all, where, update_info_for(named))
        sender.connect(where)  # the store serves on the port held since, not on one bound anew
        sender.send(sender.stage(named))
        (received,) = receiving.result()
    assert torch.equal(received, named[0][1])
    sender.close()
    assert port_is_free("127.0.0.1", where.port), "closed, the end gives the port back"


def test_a_planned_group_that_never_meets_gives_its_port_back():
    sender = GLOO.sending_end()
    first = sender.address("127.0.0.1", 0, world_size=2, timeout_s=30.0)
    second = sender.address("127.0.0.1", 0, world_size=3, timeout_s=30.0)
    assert not port_is_free("127.0.0.1", second.port)
    assert second.port == first.port or port_is_free("127.0.0.1", first.port), "the OS may pick the same port again"
    sender.close()
    assert port_is_free("127.0.0.1", second.port)


def test_update_info_round_trip_and_validation():
    named = [("x", torch.zeros(2, 3, dtype=torch.float16)), ("y", torch.zeros(4))]
    metas = parse_update_info(update_info_for(named))
    assert [(m.name, m.dtype, m.shape) for m in metas] == [("x", torch.float16, (2, 3)), ("y", torch.float32, (4,))]
    with pytest.raises(ValueError, match="differ in length"):
        parse_update_info({"names": ["x"], "dtype_names": [], "shapes": [[1]]})
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_update_info({"names": ["x"], "dtype_names": ["float99"], "shapes": [[1]]})


@pytest.mark.parametrize("tied", [True, False])
def test_output_head_is_sent_exactly_once(tied):
    shape = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=32,
                            tie_word_embeddings=tied)
    model = build_tiny_model(shape, build_char_tokenizer(), seed=0)
    names = [name for name, _ in weights_for_transfer(model)]
    assert names.count("lm_head.weight") == 1
    assert len(names) == len(set(names))


def test_staging_copies_what_the_budget_holds_to_the_device_and_leaves_the_rest():
    # 24, 400 and 16 bytes of float32; a 60-byte budget takes the first and third (400 would overrun it)
    small = torch.arange(6.0).reshape(3, 2).t()  # a view: staging must make it contiguous
    large = torch.ones(10, 10)
    tail = torch.full((4,), 2.0)
    named = [("small", small), ("large", large), ("tail", tail)]

    staged = stage_for_transfer(named, torch.device("meta"), budget_bytes=60)

    assert [name for name, _ in staged] == ["small", "large", "tail"], "order and names kept"
    assert [tensor.device.type for _, tensor in staged] == ["meta", "cpu", "meta"]
    assert staged[1][1] is large, "past the budget: left as it is, copied when sent"
    assert all(tensor.is_contiguous() for _, tensor in staged if tensor.device.type == "meta")
    assert [tensor.shape for _, tensor in staged] == [small.shape, large.shape, tail.shape]
    unstaged = stage_for_transfer(named, torch.device("meta"), budget_bytes=0)
    assert all(a is b for (_, a), (_, b) in zip(unstaged, named))


def test_staging_without_the_memory_for_it_sends_everything_unstaged(monkeypatch, caplog):
    named = [("a", torch.zeros(4)), ("b", torch.ones(4))]
    copies = []

    def to_device_until_out_of_memory(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if copies:
            raise torch.OutOfMemoryError("CUDA out of memory")
        copies.append(tensor)
        return tensor.clone()

    monkeypatch.setattr(torch.Tensor, "to", to_device_until_out_of_memory)
    staged = stage_for_transfer(named, torch.device("meta"), budget_bytes=1 << 20)

    assert all(a is b for (_, a), (_, b) in zip(staged, named)), "the original tensors, copied as they are sent"
    assert "rollout.weight_sync.staging_bytes" in caplog.text


def test_the_ipc_layout_aligns_every_tensor_and_overlaps_none():
    sizes = [6, 256, 1, 0, 700]
    offsets, total = byte_layout(sizes)
    assert offsets == [0, 256, 512, 768, 768] and total == 768 + 700
    assert all(offset % ALIGN_BYTES == 0 for offset in offsets)


def test_a_packed_buffer_reads_back_as_the_announced_tensors():
    """What the learner packs (any dtype, a transposed view among them) the server reads as views of the same
    values, by the update's names, dtypes and shapes alone."""
    named = [("a", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)), ("b", torch.arange(12.0).reshape(3, 4).t()),
             ("c", torch.tensor([7], dtype=torch.int64))]
    metas = parse_update_info(update_info_for(named))
    buffer = torch.zeros(byte_layout([t.numel() * t.element_size() for _, t in named])[1], dtype=torch.uint8)
    pack_into(buffer, named)
    views = dict(SharedWeightsReader(buffer).tensors(metas))
    assert list(views) == ["a", "b", "c"]
    assert all(torch.equal(views[name], tensor) and views[name].dtype == tensor.dtype for name, tensor in named)


def test_each_round_reads_the_values_written_since_through_views_made_once():
    """A server reads every round of a run through the same views (no slicing anew inside vLLM's update), and
    they show what the learner wrote last; another set of tensors gets views of its own."""
    first = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.arange(4, dtype=torch.bfloat16))]
    buffer = torch.zeros(byte_layout([t.numel() * t.element_size() for _, t in first])[1], dtype=torch.uint8)
    reader = SharedWeightsReader(buffer)
    pack_into(buffer, first)
    round_one = list(reader.tensors(parse_update_info(update_info_for(first))))
    second = [(name, tensor * -3) for name, tensor in first]
    pack_into(buffer, second)
    round_two = list(reader.tensors(parse_update_info(update_info_for(second))))
    assert all(view_two is view_one for (_, view_one), (_, view_two) in zip(round_one, round_two))
    assert all(torch.equal(view, tensor) for (_, view), (_, tensor) in zip(round_two, second))
    other = [("a", torch.arange(3.0))]
    (name, view), = reader.tensors(parse_update_info(update_info_for(other)))
    assert name == "a" and view.shape == (3,) and view is not round_one[0][1]


def test_an_update_larger_than_the_shared_buffer_is_refused():
    named = [("a", torch.ones(100))]
    reader = SharedWeightsReader(torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(WeightTransferError, match="needs 400 bytes and the shared buffer holds 100"):
        list(reader.tensors(parse_update_info(update_info_for(named))))
