"""The plugin's receive loop: one loader call pulls every announced tensor, received on demand and in order; loading
in place from the shared buffer, one batched copy of the planned tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncrl.weight_transfer import TransferGroup, update_info_for
from asyncrl.weight_transfer.protocol import InitInfo, UpdateInfo
from rollout_servers import vllm_compat, vllm_plugin
from rollout_servers.vllm_plugin import AsyncRLWeightTransferEngine
from rollout_servers.weight_load_plan import LoadPaths
from tests.unit.rollout_servers.fake_layers import KINDS, FakeModel, checkpoint
from tests.unit.rollout_servers.plugin_helpers import SharedBuffer, plugin_on_buffer

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


def one_worker(tensor_parallel: int = 1) -> SimpleNamespace:
    """What the plugin reads of vLLM's config: worker 0 of an engine of `tensor_parallel` workers."""
    parallel = SimpleNamespace(data_parallel_index=0, world_size=tensor_parallel, rank=0,
                               tensor_parallel_size=tensor_parallel, pipeline_parallel_size=1)
    return SimpleNamespace(parallel_config=parallel, model_config=None)


def plugin_with(group: ScriptedGroup, in_place: bool = False, model: object = None) -> AsyncRLWeightTransferEngine:
    """The plugin of worker 0 of a one-worker engine, joined to `group` as vLLM's init request would join it."""
    plugin = AsyncRLWeightTransferEngine(None, one_worker(), group.device, model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TransferGroup, "join", lambda address, rank, collectives, device, listener=None: group)
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


class CallLoggingModel(FakeModel):
    """A model built like a vLLM model whose `load_weights` logs the names of each call (and may fail)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.calls: list[list[str]] = []
        self.fail = fail

    def load_weights(self, weights) -> set[str]:
        named = list(weights)
        self.calls.append([name for name, _ in named])
        if self.fail:
            raise RuntimeError("a loader failed")
        return super().load_weights(named)


def same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> bool:
    expected = dict(reference.named_parameters())
    return all(torch.equal(param, expected[name]) for name, param in model.named_parameters())


@pytest.fixture
def fake_layers(monkeypatch) -> None:
    """The fake model's layer types stand for vLLM's standard layers."""
    monkeypatch.setattr(vllm_plugin, "vllm_layers", lambda: KINDS)


def test_loading_in_place_from_the_shared_buffer_checks_the_plan_once_then_copies_in_one_batch(fake_layers):
    buffer, model, reference = SharedBuffer(checkpoint(seed=0)), CallLoggingModel(), FakeModel()
    plugin = plugin_on_buffer(buffer, model, one_worker())
    tensors = len(checkpoint(seed=0))

    for seed, checking in ((1, True), (2, False), (3, False)):
        model.calls.clear()
        named = checkpoint(seed)
        plugin.receive_weights(buffer.write(named))
        reference.load_weights(named)
        assert same_weights(model, reference)
        assert plugin.last_load == LoadPaths(batched=tensors - 2, load_weights=1, tied=1, checked_plan=checking)
        if not checking:
            assert model.calls == [["layers.0.extra.weight"]], "only the tensors the plan leaves go through load_weights"
    assert buffer.log == ["synchronize"] * 3


def test_a_sharded_engine_streams_every_tensor_through_load_weights(fake_layers):
    buffer, model = SharedBuffer(checkpoint(seed=0)), CallLoggingModel()
    named = checkpoint(seed=1)
    plugin = plugin_on_buffer(buffer, model, one_worker(tensor_parallel=2))
    plugin.receive_weights(buffer.write(named))
    assert model.calls == [[name for name, _ in named]]
    assert plugin.last_load == LoadPaths(batched=0, load_weights=len(named))


def test_a_failing_batched_load_still_waits_for_its_copies_before_failing(fake_layers):
    buffer = SharedBuffer(checkpoint(seed=0))
    plugin = plugin_on_buffer(buffer, CallLoggingModel(fail=True), one_worker())
    with pytest.raises(RuntimeError, match="a loader failed"):
        plugin.receive_weights(buffer.write(checkpoint(seed=1)))
    assert buffer.log == ["synchronize"]


def test_a_worker_reports_how_its_last_update_loaded():
    plugin = plugin_with(ScriptedGroup(SENT), in_place=True, model=RecordingModel())
    plugin.receive_weights(announced())
    worker = SimpleNamespace(weight_transfer_engine=plugin)
    assert vllm_plugin.weight_load_paths(worker) == {"batched": 0, "load_weights": len(SENT), "tied": 0,
                                                     "checked_plan": False}
