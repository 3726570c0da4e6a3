"""The policy served as a LoRA adapter (`model.lora`): vLLM runs the base with `enable_lora`, and every request
names one adapter, the policy's, which each weight-sync round replaces with vLLM's own LoRA loading.

A round's adapter tensors travel like full weights (the learner's weight backend, into the engine's workers), but
no worker loads them into the model: in one RPC while generation is paused, every worker receives them onto its
own device (`AdapterReceiver.asyncrl_receive_adapter`, through the plugin's `receive_adapter`), builds vLLM's
`LoRAModel` from them with vLLM's `LoRAModel.from_lora_tensors` and the arguments vLLM's worker derives for a file
(`swap_adapter`), and replaces the served adapter with it in the worker's LoRA manager as vLLM's in-place reload
does (`add_lora` with `load_inplace`: remove, add, activate), so that requests in flight go on under the new
adapter, as after a full-weight update. No file is written or read, and the adapter never leaves the device: vLLM's
file path loads it to the CPU, pins each tensor in its own page-locked allocation, then copies it to the device.
Every worker swaps (each tensor-parallel rank keeps its slice: vLLM's layers slice the whole adapter on `set_lora`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name
from vllm.v1.engine.async_llm import AsyncLLM

from asyncrl.config.sections import LoraConfig
from rollout_servers import vllm_compat

POLICY_ADAPTER_NAME = "asyncrl-policy"
POLICY_ADAPTER_ID = 1  # vLLM's id of the one adapter a server serves (ids start at 1)
# What a request's LoRARequest names as the adapter's path (vLLM wants one). vLLM never reads it: the workers hold
# the adapter before any request names it, and vLLM loads an adapter from its path only when a worker lacks it; then
# this path, which holds nothing, fails that load (LoRAAdapterNotFoundError) instead of serving a stale adapter.
ADAPTER_PATH = "/asyncrl-policy-adapter/swapped-in-by-each-worker"
SERVED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's max_lora_rank takes


def served_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for an adapter of `rank`: the smallest value it takes that holds it."""
    return next(served for served in SERVED_RANKS if served >= rank)


class ServedAdapter:
    """This server's adapter: its settings, sent to the workers with each round, and the LoRA request that names it.
    Until the first round the server samples the base alone: that is policy version 0, since PEFT starts every
    adapter's B at zero."""

    def __init__(self, lora: LoraConfig) -> None:
        self._settings = lora.peft_fields()  # PEFT's adapter_config.json fields, which vLLM's PEFTHelper reads
        self._request = LoRARequest(POLICY_ADAPTER_NAME, POLICY_ADAPTER_ID, ADAPTER_PATH)
        self._loaded = False

    @property
    def request(self) -> LoRARequest | None:
        """What a generation request names: the policy's adapter once one arrived, else None (the base)."""
        return self._request if self._loaded else None

    async def load(self, llm: AsyncLLM, update_info: dict[str, Any]) -> None:
        """Have every worker receive the round's adapter (announced by `update_info`) and swap it in. Call while
        generation is paused: the next step of every request runs under the new adapter."""
        await llm.collective_rpc(RECEIVE_METHOD, args=(update_info, self._settings))
        self._loaded = True


class AdapterReceiver:
    """Mixed into vLLM's worker class (`worker_extension_cls`) when the policy is served as an adapter."""

    def asyncrl_receive_adapter(self, update_info: dict[str, Any], settings: dict[str, Any]) -> dict[str, float]:
        """Receive the announced adapter tensors from the trainer and swap them in as the served adapter. Returns
        this worker's seconds: `adapter_receive` (received and copied onto the device) and `adapter_load` (vLLM's
        adapter built and swapped in; its device copies are queued, not awaited), for benchmarks."""
        started = time.perf_counter()
        engine = self.weight_transfer_engine
        tensors = engine.receive_adapter(engine.parse_update_info(update_info))
        received = time.perf_counter()
        swap_adapter(self.model_runner.lora_manager, tensors, settings)
        return {"adapter_receive": received - started, "adapter_load": time.perf_counter() - received}


def swap_adapter(lora_manager: Any, tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> None:
    """Replace the served adapter in a worker's LoRA manager (vLLM's `WorkerLoRAManager`) by the one of `tensors`
    (PEFT's names, on the worker's device, the caller's to give away: vLLM scales some in place) and `settings`
    (PEFT's adapter config).

    The adapter is built as vLLM's worker builds one from a file (`_load_adapter`: PEFTHelper of the config, checked
    against the engine's LoRA config; the modules the model serves LoRA on; its name mapper and skipped prefixes;
    the LoRA dtype and vocabulary size), with vLLM's `LoRAModel.from_lora_tensors` on the worker's own device, so
    nothing is pinned and `set_lora` copies device to device. It replaces the served one as vLLM's in-place reload
    does (`add_adapter` with `load_inplace`): remove, add, activate, into the same slot."""
    manager = lora_manager._adapter_manager
    model = manager.model
    helper = PEFTHelper.from_dict(settings | {"vllm_max_position_embeddings": lora_manager.max_position_embeddings})
    helper.validate_legal(lora_manager.lora_config)
    mapper = vllm_compat.lora_weights_mapper(model)
    skipped = getattr(model, "lora_skip_prefixes", None)
    unexpected = _unexpected_modules(tensors, _expected_modules(manager), mapper, skipped, lora_manager._lora_model_cls)
    if unexpected:
        raise ValueError(f"the adapter has LoRA weights for {unexpected}, modules vLLM serves no LoRA on "
                         f"(it serves {sorted(_expected_modules(manager))}); check model.lora.target_modules")
    lora = lora_manager._lora_model_cls.from_lora_tensors(
        POLICY_ADAPTER_ID, tensors, helper, device=lora_manager.device, dtype=lora_manager.lora_config.lora_dtype,
        model_vocab_size=lora_manager.vocab_size, weights_mapper=mapper, skip_prefixes=skipped)
    vllm_compat.check_loaded_adapter(manager, lora)
    with vllm_compat.adapter_swap_syncs():
        manager.remove_adapter(lora.id)
        manager.add_adapter(lora)
        manager.activate_adapter(lora.id)


def _expected_modules(manager: Any) -> set[str]:
    """The module names an adapter may carry LoRA weights for, as vLLM's `_load_adapter` derives them: the modules
    the model serves LoRA on, a packed one (qkv_proj) by its parts (q_proj, k_proj, v_proj)."""
    expected: set[str] = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def _unexpected_modules(tensors: dict[str, torch.Tensor], expected: set[str], mapper: Any,
                        skipped: list[str] | None, lora_model_cls: Any) -> list[str]:
    """The adapter's modules outside `expected`, found as vLLM's `from_local_checkpoint` finds them in a file (vLLM
    would otherwise load them and serve the adapter without them)."""
    unexpected = []
    for name in tensors:
        if is_base_embedding_weights(name) or "base_layer" in name:
            continue
        if skipped and lora_model_cls._should_skip_module(name, skipped):
            continue
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        served = module[module.find(".experts") + 1:] if ".experts" in module else module.rsplit(".", 1)[-1]
        if served not in expected:
            unexpected.append(module)
    return unexpected


RECEIVE_METHOD = AdapterReceiver.asyncrl_receive_adapter.__name__  # what the engine asks its workers to run
WORKER_EXTENSION = f"{AdapterReceiver.__module__}.{AdapterReceiver.__qualname__}"  # vLLM's worker_extension_cls
