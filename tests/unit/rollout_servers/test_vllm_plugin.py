"""The plugin's receive loop: one loader call pulls every announced tensor, received on demand and in order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncrl.weight_transfer import TransferGroup, update_info_for
from asyncrl.weight_transfer.protocol import InitInfo, UpdateInfo
from rollout_servers import vllm_compat
from rollout_servers.vllm_plugin import AsyncRLWeightTransferEngine

SENT = [("a.weight", torch.full((2, 3), 1.5)), ("b.bias", torch.arange(4, dtype=torch.float32)),
        ("c.weight", torch.full((1,), -2.0))]


class ScriptedGroup:
    """Stands in for the transfer group: each broadcast fills the next sent tensor and is logged."""

    device = torch.device("cpu")

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._pending = [tensor for _, tensor in tensors]
        self.log: list[str] = []

    def broadcast(self, buffer: torch.Tensor) -> None:
        buffer.copy_(self._pending.pop(0))
        self.log.append("broadcast")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def plugin_with(group: ScriptedGroup, in_place: bool = False, model: object = None) -> AsyncRLWeightTransferEngine:
    """The plugin of worker 0 of a one-worker engine, joined to `group` as vLLM's init request would join it."""
    one_worker = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                 model_config=None)
    plugin = AsyncRLWeightTransferEngine(None, one_worker, group.device, model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TransferGroup, "join", lambda address, rank, collectives, device: group)
        plugin.init_transfer_engine(InitInfo("127.0.0.1", 1, 2, "gloo", 1.0, rank_offset=1, load_in_place=in_place))
    return plugin


def announced() -> UpdateInfo:
    return UpdateInfo(**update_info_for(SENT))


def test_one_loader_call_receives_each_tensor_just_before_it_is_loaded() -> None:
    group = ScriptedGroup(SENT)
    calls: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(weights) -> None:
        loaded = []
        for name, tensor in weights:
            group.log.append(f"load {name}")
            loaded.append((name, tensor.clone()))
        calls.append(loaded)

    plugin_with(group).receive_weights(announced(), load_weights)

    assert len(calls) == 1
    assert [name for name, _ in calls[0]] == [name for name, _ in SENT]
    for (_, got), (_, sent) in zip(calls[0], SENT):
        assert torch.equal(got, sent)
    assert group.log == ["broadcast", "load a.weight", "broadcast", "load b.bias", "broadcast", "load c.weight", "synchronize"]


def test_a_loader_that_stops_early_still_completes_the_round_then_fails() -> None:
    group = ScriptedGroup(SENT)

    def load_first_only(weights) -> None:
        next(iter(weights))

    with pytest.raises(RuntimeError, match="stopped before 2 announced tensors, first 'b.bias'"):
        plugin_with(group).receive_weights(announced(), load_first_only)
    assert group.log == ["broadcast", "broadcast", "broadcast", "synchronize"]


class RecordingModel:
    """The model's own checkpoint-format loader, as vLLM models expose it."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_weights(self, weights) -> None:
        self.loaded += [name for name, _ in weights]


def test_loading_in_place_uses_the_models_own_loader_not_the_one_handed_in() -> None:
    model = RecordingModel()

    def kernel_format_loader(weights) -> None:
        raise AssertionError("vLLM 0.24's kernel-format loader cannot take checkpoint names")

    plugin_with(ScriptedGroup(SENT), in_place=True, model=model).receive_weights(announced(), kernel_format_loader)
    assert model.loaded == [name for name, _ in SENT]


def test_loading_in_place_is_chosen_only_for_unquantized_models_on_cuda(monkeypatch) -> None:
    from vllm.platforms import current_platform

    unquantized, quantized = SimpleNamespace(quantization=None), SimpleNamespace(quantization="fp8")
    assert not vllm_compat.loads_in_place(True, unquantized), "CPU repacks linear weights after loading"
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    assert vllm_compat.loads_in_place(True, unquantized)
    assert not vllm_compat.loads_in_place(False, unquantized)
    assert not vllm_compat.loads_in_place(True, quantized)
