"""The policy served as a LoRA adapter, without an engine: the workers' receive (the plugin's `receive_adapter`),
the swap into vLLM's LoRA manager (`swap_adapter`, with vLLM's own `LoRAModel`), the server's requests, and the
engine arguments that turn LoRA on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from vllm.lora.lora_model import LoRAModel

from asyncrl.config.rollout import EngineConfig
from asyncrl.config.sections import LoraConfig
from rollout_servers.adapter import (ADAPTER_PATH, POLICY_ADAPTER_ID, RECEIVE_METHOD, ServedAdapter, served_rank,
                                     swap_adapter)
from rollout_servers.engine import _naming_lora_when_start_fails
from rollout_servers.engine_args import engine_args
from test_vllm_plugin import SENT, ScriptedGroup, announced, one_worker, plugin_with
from tests.unit.rollout_servers.plugin_helpers import SharedBuffer, plugin_on_buffer

LORA = LoraConfig(enabled=True, rank=12, alpha=24.0, target_modules=["q_proj", "v_proj"])


def test_a_worker_receives_the_whole_adapter_as_tensors_of_its_own():
    group = ScriptedGroup(SENT)
    received = plugin_with(group).receive_adapter(announced())
    assert group.log == ["broadcast"] * len(SENT) + ["synchronize"]  # the whole round, then the copies are done
    assert list(received) == [name for name, _ in SENT]
    assert all(torch.equal(received[name], tensor) for name, tensor in SENT)


def test_an_adapter_received_from_a_shared_buffer_outlives_the_next_round():
    buffer = SharedBuffer(SENT)
    plugin = plugin_on_buffer(buffer, torch.nn.Module(), one_worker())
    received = plugin.receive_adapter(buffer.write(SENT))
    buffer.write([(name, torch.zeros_like(tensor)) for name, tensor in SENT])  # the learner's next round
    assert buffer.log == ["synchronize"]
    assert all(torch.equal(received[name], tensor) for name, tensor in SENT)


def peft_names(module: str, layer: int = 0) -> tuple[str, str]:
    prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
    return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"


class LoRAManager:
    """Stands in for vLLM's worker LoRA manager (`WorkerLoRAManager`) and its model manager, serving LoRA on a
    packed qkv_proj and on o_proj, with vLLM's own `LoRAModel`; records the swap."""

    def __init__(self, max_rank: int = 16) -> None:
        self.calls: list[tuple[str, int]] = []
        self.added: list[LoRAModel] = []
        self._adapter_manager = SimpleNamespace(
            model=torch.nn.Module(), supported_lora_modules=["qkv_proj", "o_proj"],
            packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
            remove_adapter=lambda adapter_id: self.calls.append(("remove", adapter_id)),
            add_adapter=lambda lora: self.calls.append(("add", lora.id)) or self.added.append(lora),
            activate_adapter=lambda adapter_id: self.calls.append(("activate", adapter_id)))
        self.lora_config = SimpleNamespace(max_lora_rank=max_rank, lora_dtype=torch.float32)
        self.max_position_embeddings, self.vocab_size, self.device = 64, 100, torch.device("cpu")
        self._lora_model_cls = LoRAModel


def adapter(*modules: str, rank: int = 12) -> dict[str, torch.Tensor]:
    tensors = {}
    for module in modules:
        a, b = peft_names(module)
        tensors[a], tensors[b] = torch.randn(rank, 8), torch.randn(8, rank)
    return tensors


def test_the_swap_builds_vllms_adapter_of_the_tensors_and_replaces_the_served_one_in_place():
    manager, tensors = LoRAManager(), adapter("q_proj", "v_proj")
    lora_a = tensors[peft_names("q_proj")[0]].clone()
    swap_adapter(manager, tensors, LORA.peft_fields())
    assert manager.calls == [("remove", POLICY_ADAPTER_ID), ("add", POLICY_ADAPTER_ID), ("activate", POLICY_ADAPTER_ID)]
    built = manager.added[0].get_lora("model.layers.0.self_attn.q_proj")
    assert (built.rank, built.scaling) == (12, 2.0)  # alpha / rank, from the adapter's settings
    assert torch.equal(built.lora_a, lora_a) and not built.lora_a.is_pinned()


@pytest.mark.parametrize("modules, rank, refusal", [(("q_proj", "gate_proj"), 12, "gate_proj"),
                                                    (("q_proj",), 32, "max_lora_rank")])
def test_an_adapter_vllm_cannot_serve_fails_before_the_served_one_is_removed(modules, rank, refusal):
    manager = LoRAManager()
    settings = LORA.peft_fields() | {"r": rank}
    with pytest.raises(ValueError, match=refusal):
        swap_adapter(manager, adapter(*modules, rank=rank), settings)
    assert manager.calls == []


class AdapterLLM:
    """Stands in for AsyncLLM's worker call: records it, or fails it."""

    def __init__(self, fails: bool = False) -> None:
        self.calls: list[tuple] = []
        self._fails = fails

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[dict[str, float]]:
        self.calls.append((method, *args))
        if self._fails:
            raise RuntimeError("worker failed")
        return [{"adapter_receive": 0.0, "adapter_load": 0.0}]


def test_the_server_samples_the_base_until_every_worker_swapped_an_adapter_in():
    served = ServedAdapter(LORA)
    assert served.request is None
    llm = AdapterLLM()
    asyncio.run(served.load(llm, {"names": ["x"]}))
    settings = {"r": 12, "lora_alpha": 24.0, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                "bias": "none"}
    assert llm.calls == [(RECEIVE_METHOD, {"names": ["x"]}, settings)]
    # requests name the adapter the workers hold, without reloading it: vLLM never reads its path
    assert (served.request.lora_int_id, served.request.lora_path, served.request.load_inplace) == \
        (POLICY_ADAPTER_ID, ADAPTER_PATH, False)


def test_a_failed_swap_leaves_the_server_on_the_base():
    served = ServedAdapter(LORA)
    with pytest.raises(RuntimeError, match="worker failed"):
        asyncio.run(served.load(AdapterLLM(fails=True), {}))
    assert served.request is None


@pytest.mark.parametrize("rank, served", [(1, 1), (2, 8), (16, 16), (17, 32), (300, 320), (512, 512)])
def test_vllm_is_started_for_the_smallest_rank_it_takes_that_holds_the_adapter(rank, served):
    assert served_rank(rank) == served


def test_engine_arguments_serve_one_adapter_only_with_lora_on(tmp_path):
    lora_on = engine_args(str(tmp_path), EngineConfig(), 8, LORA)
    assert (lora_on.enable_lora, lora_on.max_lora_rank, lora_on.max_loras, lora_on.max_cpu_loras) == (True, 16, 1, 1)
    assert lora_on.worker_extension_cls == "rollout_servers.adapter.AdapterReceiver"
    for lora in (None, LoraConfig()):
        lora_off = engine_args(str(tmp_path), EngineConfig(), 8, lora)
        assert not lora_off.enable_lora and not lora_off.worker_extension_cls


def test_an_engine_that_fails_to_start_with_lora_names_the_key():
    with pytest.raises(RuntimeError, match="model.lora.enabled=true") as failed:
        with _naming_lora_when_start_fails(True):
            raise ValueError("Qwen3NextForCausalLM does not support LoRA yet.")
    assert "does not support LoRA yet" in str(failed.value)
    with pytest.raises(ValueError, match="^no adapter$"):  # without LoRA the engine's own error goes through
        with _naming_lora_when_start_fails(False):
            raise ValueError("no adapter")
