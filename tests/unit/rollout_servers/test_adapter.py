"""The policy served as a LoRA adapter, without an engine: the workers' receive (the plugin's `receive_adapter`), the
adapter built with vLLM's own `LoRAModel` (`build_adapter`), staged in the free slot on a thread and switched to
(`flip_slots`, `flip_at_step_boundary`), the server's requests and the counts it reads at a switch, and the engine
arguments that turn LoRA on."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch
from vllm.lora.lora_model import LoRAModel

from asyncrl.config.rollout import EngineConfig
from asyncrl.config.sections import LoraConfig
from rollout_servers import vllm_compat
from rollout_servers.adapter import (ADAPTER_PATH, FLIP_METHOD, FLIP_UTILITY, POLICY_ADAPTER_ID, STAGE_METHOD,
                                     STAGED_METHOD, AdapterStaging, ServedAdapter, build_adapter, flip_at_step_boundary,
                                     flip_slots, free_slot, served_rank, write_slot)
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
    packed qkv_proj and on o_proj, with vLLM's own `LoRAModel`; records the merge of packed modules."""

    def __init__(self, max_rank: int = 16) -> None:
        self.merged: list[LoRAModel] = []
        self._adapter_manager = SimpleNamespace(
            model=torch.nn.Module(), supported_lora_modules=["qkv_proj", "o_proj"],
            packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
            _create_merged_loras_inplace=self.merged.append)
        self.lora_config = SimpleNamespace(max_lora_rank=max_rank, lora_dtype=torch.float32)
        self.max_position_embeddings, self.vocab_size, self.device = 64, 100, torch.device("cpu")
        self._lora_model_cls = LoRAModel


def adapter(*modules: str, rank: int = 12) -> dict[str, torch.Tensor]:
    tensors = {}
    for module in modules:
        a, b = peft_names(module)
        tensors[a], tensors[b] = torch.randn(rank, 8), torch.randn(8, rank)
    return tensors


def test_the_adapter_is_built_as_vllm_builds_one_from_a_file_with_its_packed_modules_merged():
    manager, tensors = LoRAManager(), adapter("q_proj", "v_proj")
    lora_a = tensors[peft_names("q_proj")[0]].clone()
    built = build_adapter(manager, tensors, LORA.peft_fields())
    assert manager.merged == [built] and built.id == POLICY_ADAPTER_ID
    layer = built.get_lora("model.layers.0.self_attn.q_proj")
    assert (layer.rank, layer.scaling) == (12, 2.0)  # alpha / rank, from the adapter's settings
    assert torch.equal(layer.lora_a, lora_a) and not layer.lora_a.is_pinned()


@pytest.mark.parametrize("modules, rank, refusal", [(("q_proj", "gate_proj"), 12, "gate_proj"),
                                                    (("q_proj",), 32, "max_lora_rank")])
def test_an_adapter_vllm_cannot_serve_is_refused_before_anything_is_written(modules, rank, refusal):
    manager = LoRAManager()
    settings = LORA.peft_fields() | {"r": rank}
    with pytest.raises(ValueError, match=refusal):
        build_adapter(manager, adapter(*modules, rank=rank), settings)
    assert manager.merged == []


class Layer:
    """A LoRA layer of vLLM's model: records what each slot was given."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple] = {}

    def set_lora(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        self.slots[slot] = (lora_a, lora_b)

    def reset_lora(self, slot: int) -> None:
        self.slots[slot] = ()


def model_manager(slots: list[int | None]) -> SimpleNamespace:
    """vLLM's LoRA model manager as the switch sees it: its slots, its adapters, its layers."""
    weights = {"qkv_proj": SimpleNamespace(lora_a="A", lora_b="B")}
    return SimpleNamespace(lora_index_to_id=slots, _registered_adapters={}, _active_adapters={}, _last_mapping="last",
                           modules={"qkv_proj": Layer(), "o_proj": Layer()},
                           _get_lora_layer_weights=lambda lora, name: weights.get(name))


def test_the_next_adapter_is_written_into_the_free_slot_only_and_zero_where_it_has_no_weights():
    manager = model_manager([POLICY_ADAPTER_ID, None])
    slot = free_slot(manager)
    write_slot(manager, object(), slot)
    assert slot == 1
    assert manager.modules["qkv_proj"].slots == {1: ("A", "B")} and manager.modules["o_proj"].slots == {1: ()}


def test_without_a_free_slot_nothing_is_staged():
    with pytest.raises(RuntimeError, match="max_loras=2"):
        free_slot(model_manager([POLICY_ADAPTER_ID]))


def test_a_switch_points_the_policys_id_at_the_staged_slot_and_frees_the_old_one():
    manager, first, second = model_manager([None, None]), object(), object()
    flip_slots(manager, first, 0)  # the first round: no adapter served before
    assert manager.lora_index_to_id == [POLICY_ADAPTER_ID, None]
    flip_slots(manager, second, 1)
    assert manager.lora_index_to_id == [None, POLICY_ADAPTER_ID]
    assert manager._registered_adapters == {POLICY_ADAPTER_ID: second}
    assert manager._active_adapters == {POLICY_ADAPTER_ID: None}
    assert manager._last_mapping is None  # the next step recomputes which slot each token reads


def test_staging_runs_on_a_thread_and_its_error_reaches_the_next_ask():
    release = threading.Event()

    def receive() -> dict[str, torch.Tensor]:
        release.wait(5)
        raise ConnectionError("trainer gone")

    staging = AdapterStaging(receive, LoRAManager(), LORA.peft_fields())
    assert staging.running() and staging.seconds() is None  # the engine is not held while it receives
    release.set()
    staging._thread.join(5)
    with pytest.raises(ConnectionError, match="trainer gone"):
        staging.seconds()


def test_a_staged_adapter_lands_in_the_free_slot_with_its_seconds():
    manager = LoRAManager()
    manager._adapter_manager.__dict__.update(vars(model_manager([POLICY_ADAPTER_ID, None])))
    staging = AdapterStaging(lambda: adapter("q_proj", "v_proj"), manager, LORA.peft_fields())
    staging._thread.join(5)
    assert set(staging.seconds()) == {"adapter_receive", "adapter_load"}
    assert staging.slot == 1 and staging.lora.id == POLICY_ADAPTER_ID
    assert manager._adapter_manager.modules["qkv_proj"].slots[1] == ("A", "B")


def test_the_engine_core_counts_the_tokens_in_flight_as_the_old_adapters():
    calls = []
    requests = {"a-1": SimpleNamespace(num_output_tokens=5, num_output_placeholders=2),  # a batch still in flight
                "b-2": SimpleNamespace(num_output_tokens=0, num_output_placeholders=0)}
    core = SimpleNamespace(model_executor=SimpleNamespace(collective_rpc=calls.append),
                           scheduler=SimpleNamespace(requests=requests))
    answer = flip_at_step_boundary(core)
    assert calls == [FLIP_METHOD] and answer["sampled"] == {"a-1": 7, "b-2": 0} and answer["seconds"] >= 0


def test_counts_are_read_back_by_our_request_ids():
    processor = SimpleNamespace(external_req_ids={"ours": ["ours-x1"], "new": ["new-x2"], "done": ["done-x3"]},
                                request_states={"ours-x1": 0, "new-x2": 0})
    engine = SimpleNamespace(output_processor=processor)
    counts = vllm_compat.core_counts_by_request(engine, {"ours-x1": 9}, ["ours", "new", "done"])
    # not yet in the core: every token is the new adapter's; finished: every token was the old one's
    assert counts == {"ours": 9, "new": 0, "done": None}


class AdapterLLM:
    """Stands in for AsyncLLM's worker and engine-core calls: records them; the workers hold the adapter after
    `staged_after` asks, or fail."""

    def __init__(self, fails: bool = False, staged_after: int = 2) -> None:
        self.calls: list[tuple] = []
        self._fails, self._asks_left = fails, staged_after
        self.engine_core = SimpleNamespace(call_utility_async=self._utility)

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[dict[str, float] | None]:
        self.calls.append((method, *args))
        if self._fails:
            raise RuntimeError("worker failed")
        if method == STAGED_METHOD:
            self._asks_left -= 1
            return [None] if self._asks_left > 0 else [{"adapter_receive": 0.5, "adapter_load": 0.25}]
        return [None]

    async def _utility(self, name: str) -> dict:
        self.calls.append((name,))
        return {"sampled": {"r": 3}, "seconds": 0.001}


def test_the_server_samples_the_base_until_every_worker_switched_to_an_adapter():
    served = ServedAdapter(LORA)
    assert served.request is None
    llm = AdapterLLM()
    staged = asyncio.run(served.stage(llm, {"names": ["x"]}, deadline_s=5))
    assert staged == {"adapter_receive": 0.5, "adapter_load": 0.25} and served.request is None
    flip = asyncio.run(served.flip(llm))
    settings = {"r": 12, "lora_alpha": 24.0, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                "bias": "none"}
    assert llm.calls == [(STAGE_METHOD, {"names": ["x"]}, settings), (STAGED_METHOD,), (STAGED_METHOD,),
                         (FLIP_UTILITY,)]
    assert (flip.sampled, flip.seconds) == ({"r": 3}, 0.001)
    # requests name the adapter the workers hold, without reloading it: vLLM never reads its path
    assert (served.request.lora_int_id, served.request.lora_path, served.request.load_inplace) == \
        (POLICY_ADAPTER_ID, ADAPTER_PATH, False)


def test_a_failed_stage_leaves_the_server_on_what_it_served():
    served = ServedAdapter(LORA)
    with pytest.raises(RuntimeError, match="worker failed"):
        asyncio.run(served.stage(AdapterLLM(fails=True), {}, deadline_s=5))
    assert served.request is None


def test_staging_that_outlasts_its_deadline_is_given_up():
    with pytest.raises(TimeoutError, match="within 0s"):
        asyncio.run(ServedAdapter(LORA).stage(AdapterLLM(staged_after=10**6), {}, deadline_s=0.01))


@pytest.mark.parametrize("rank, served", [(1, 1), (2, 8), (16, 16), (17, 32), (300, 320), (512, 512)])
def test_vllm_is_started_for_the_smallest_rank_it_takes_that_holds_the_adapter(rank, served):
    assert served_rank(rank) == served


def test_engine_arguments_serve_adapters_only_with_lora_on(tmp_path):
    lora_on = engine_args(str(tmp_path), EngineConfig(), 8, LORA)
    assert (lora_on.enable_lora, lora_on.max_lora_rank, lora_on.max_loras, lora_on.max_cpu_loras) == (True, 16, 2, 2)  # the served slot and the staging one
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
