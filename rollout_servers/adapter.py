"""The policy served as a LoRA adapter (`model.lora`): vLLM runs the base with `enable_lora`, and every request
names one adapter, the policy's, which each weight-sync round replaces with vLLM's own LoRA loading.

A round's adapter tensors travel like full weights (the learner's weight backend, into the engine's workers), but
no worker loads them into the model: the engine's first worker writes them as PEFT's adapter file into a directory
of this server (`AdapterReceiver.asyncrl_receive_adapter`, through the plugin's `receive_adapter`), and the engine
then reloads the adapter from there in place (`add_lora` with `load_inplace`) while generation is paused, so that
requests in flight go on under the new adapter, as after a full-weight update. vLLM takes adapters from files only
(a `LoRARequest` names a path), hence the directory; it lives in shared memory where the machine has it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM

from asyncrl.config.sections import LoraConfig

ADAPTER_CONFIG_FILE = "adapter_config.json"  # PEFT's names, which vLLM's LoRA loading reads
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
POLICY_ADAPTER_NAME = "asyncrl-policy"
POLICY_ADAPTER_ID = 1  # vLLM's id of the one adapter a server serves (ids start at 1)
SERVED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's max_lora_rank takes
_SHARED_MEMORY = Path("/dev/shm")


def served_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for an adapter of `rank`: the smallest value it takes that holds it."""
    return next(served for served in SERVED_RANKS if served >= rank)


def write_adapter_weights(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Write the adapter file into `directory` atomically: vLLM never reads a half-written one."""
    partial = directory / f"{ADAPTER_WEIGHTS_FILE}.partial"
    save_file(tensors, str(partial))
    os.replace(partial, directory / ADAPTER_WEIGHTS_FILE)


class ServedAdapter:
    """This server's adapter directory and the LoRA request that names it. Until the first round the server samples
    the base alone: that is policy version 0, since PEFT starts every adapter's B at zero."""

    def __init__(self, lora: LoraConfig, model_path: str) -> None:
        place = _SHARED_MEMORY if os.access(_SHARED_MEMORY, os.W_OK) else None
        self.directory = Path(tempfile.mkdtemp(prefix="asyncrl-adapter-", dir=place))
        settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model_path}
        (self.directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(settings | lora.peft_fields()))
        self._request = LoRARequest(POLICY_ADAPTER_NAME, POLICY_ADAPTER_ID, str(self.directory))
        self._loaded = False

    @property
    def request(self) -> LoRARequest | None:
        """What a generation request names: the policy's adapter once one arrived, else None (the base)."""
        return self._request if self._loaded else None

    async def load(self, llm: AsyncLLM, update_info: dict[str, Any]) -> None:
        """Receive the round's adapter (announced by `update_info`) into the directory and have vLLM reload it in
        place. Call while generation is paused: the next step of every request runs under the new adapter."""
        await llm.collective_rpc(RECEIVE_METHOD, args=(update_info, str(self.directory)))
        reload = LoRARequest(POLICY_ADAPTER_NAME, POLICY_ADAPTER_ID, str(self.directory), load_inplace=True)
        if not await llm.add_lora(reload):
            raise RuntimeError(f"vLLM did not load the adapter written to {self.directory}")
        self._loaded = True

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class AdapterReceiver:
    """Mixed into vLLM's worker class (`worker_extension_cls`) when the policy is served as an adapter."""

    def asyncrl_receive_adapter(self, update_info: dict[str, Any], directory: str) -> None:
        """Receive the announced adapter tensors from the trainer; the engine's first worker writes them."""
        engine = self.weight_transfer_engine
        engine.receive_adapter(engine.parse_update_info(update_info), Path(directory),
                               write=self.parallel_config.rank == 0)


RECEIVE_METHOD = AdapterReceiver.asyncrl_receive_adapter.__name__  # what the engine asks its workers to run
WORKER_EXTENSION = f"{AdapterReceiver.__module__}.{AdapterReceiver.__qualname__}"  # vLLM's worker_extension_cls
