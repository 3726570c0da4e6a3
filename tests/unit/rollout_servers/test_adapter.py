"""The policy served as a LoRA adapter, without an engine: the workers' receive (the plugin's `receive_adapter`),
the server's adapter directory and requests, and the engine arguments that turn LoRA on."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.config.rollout import EngineConfig
from asyncrl.config.sections import LoraConfig
from rollout_servers.adapter import (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, POLICY_ADAPTER_ID, RECEIVE_METHOD,
                                     ServedAdapter, served_rank)
from rollout_servers.engine import _naming_lora_when_start_fails
from rollout_servers.engine_args import engine_args
from test_vllm_plugin import SENT, ScriptedGroup, announced, plugin_with

LORA = LoraConfig(enabled=True, rank=12, alpha=24.0, target_modules=["q_proj", "v_proj"])


@pytest.mark.parametrize("write", [True, False])
def test_every_worker_receives_the_adapter_and_the_first_writes_it(tmp_path, write):
    group = ScriptedGroup(SENT)
    plugin_with(group).receive_adapter(announced(), tmp_path, write=write)
    assert group.log == ["broadcast"] * len(SENT) + ["synchronize"]  # the whole round, written or not
    if write:
        written = load_file(tmp_path / ADAPTER_WEIGHTS_FILE)
        assert list(written) == sorted(name for name, _ in SENT)
        assert all(torch.equal(written[name], tensor) for name, tensor in SENT)
    assert [path.name for path in tmp_path.iterdir()] == ([ADAPTER_WEIGHTS_FILE] if write else [])


class AdapterLLM:
    """Stands in for AsyncLLM's worker call and LoRA loading: records both."""

    def __init__(self, loads: bool = True) -> None:
        self.calls: list[tuple] = []
        self._loads = loads

    async def collective_rpc(self, method: str, args: tuple = ()) -> None:
        self.calls.append(("rpc", method, *args))

    async def add_lora(self, request) -> bool:
        self.calls.append(("add_lora", request.lora_path, request.lora_int_id, request.load_inplace))
        return self._loads


def test_the_server_samples_the_base_until_an_adapter_is_swapped_in_place():
    adapter = ServedAdapter(LORA, "/models/base")
    try:
        settings = json.loads((adapter.directory / ADAPTER_CONFIG_FILE).read_text())
        assert settings == {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "/models/base",
                            "r": 12, "lora_alpha": 24.0, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                            "bias": "none"}
        assert adapter.request is None
        llm = AdapterLLM()
        asyncio.run(adapter.load(llm, {"names": ["x"]}))
        directory = str(adapter.directory)
        assert llm.calls == [("rpc", RECEIVE_METHOD, {"names": ["x"]}, directory),
                             ("add_lora", directory, POLICY_ADAPTER_ID, True)]
        # requests name the adapter without reloading it each step
        assert (adapter.request.lora_path, adapter.request.load_inplace) == (directory, False)
    finally:
        adapter.close()
    assert not adapter.directory.exists()


def test_an_adapter_vllm_does_not_load_fails_the_round():
    adapter = ServedAdapter(LORA, "/models/base")
    try:
        with pytest.raises(RuntimeError, match="did not load the adapter"):
            asyncio.run(adapter.load(AdapterLLM(loads=False), {}))
        assert adapter.request is None
    finally:
        adapter.close()


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


def test_an_engine_that_fails_to_start_with_lora_names_the_key_and_leaves_no_directory():
    adapter = ServedAdapter(LORA, "/models/base")
    with pytest.raises(RuntimeError, match="model.lora.enabled=true") as failed:
        with _naming_lora_when_start_fails(adapter):
            raise ValueError("Qwen3NextForCausalLM does not support LoRA yet.")
    assert "does not support LoRA yet" in str(failed.value) and not adapter.directory.exists()
    with pytest.raises(ValueError, match="^no adapter$"):  # without LoRA the engine's own error goes through
        with _naming_lora_when_start_fails(None):
            raise ValueError("no adapter")
