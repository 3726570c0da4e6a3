"""vLLM plugin: our weight-transfer engine, registered in every vLLM process via `vllm.general_plugins`.

The worker side of `asyncrl.weight_transfer`: at `init_weight_transfer_engine` it gets the receiving end of the
backend the init request names (it joins the trainer's private gloo/NCCL group, or maps the trainer's CUDA IPC
buffer on the same GPU), and on `update_weights` pulls each announced tensor from it and feeds it to the model's
`load_weights`: inside vLLM's layerwise reload (started and finished by `start_weight_update` /
`finish_weight_update`), or straight into the serving parameters where the engine chose to load in place
(`vllm_compat.loads_in_place`). A policy served as a LoRA adapter is received by `receive_adapter` instead.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from asyncrl.parent_death import die_with_spawning_parent
from asyncrl.weight_transfer import BACKEND_NAME, ReceivingEnd, weight_backend
from asyncrl.weight_transfer.protocol import InitInfo, UpdateInfo
from rollout_servers import vllm_compat
from rollout_servers.adapter import write_adapter_weights
from rollout_servers.vllm_log_filters import drop_expected_warnings

log = logging.getLogger(__name__)


def register() -> None:
    """Entry point named in pyproject.toml; vLLM calls it in its engine and worker processes."""
    die_with_spawning_parent()  # vLLM's engine core and workers: gone with the server that started them
    drop_expected_warnings()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, __name__, AsyncRLWeightTransferEngine.__name__)
    except ValueError:  # registered already: the plugin loader ran twice in this process
        log.debug("weight-transfer engine '%s' already registered", BACKEND_NAME)


class AsyncRLWeightTransferEngine(vllm_compat.LegacyTrainerHooks, vllm_compat.WeightTransferEngine):
    init_info_cls = InitInfo
    update_info_cls = vllm_compat.DenseUpdateInfo

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._weights: ReceivingEnd | None = None  # where the trainer's weights come from, once joined
        self._in_place = False  # set at each join from the init request

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Join (or rejoin, after a failed round) the trainer's weights as the init request says; the previous
        receiving end is dropped once the new one is up, and kept when it still reaches the same weights."""
        rank = init_info.rank_offset + vllm_compat.worker_index(self.parallel_config)
        # Read the device before any update: during a reload the model sits on the meta device, so a
        # rejoin after a failed round takes the previous end's.
        device = self._weights.device if self._weights is not None else vllm_compat.engine_device(self)
        joined = weight_backend(init_info.backend).receiving_end(init_info, rank, device, self._weights)
        if joined is not self._weights:
            self.shutdown()
            self._weights = joined
        self._in_place = init_info.load_in_place

    def start_weight_update(self) -> None:
        if not self._in_place:
            vllm_compat.layerwise_reload_start(self.model)

    def finish_weight_update(self) -> None:
        if not self._in_place:
            vllm_compat.layerwise_reload_finish(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse, receive and load one update. On any failure the reload is finished before re-raising.

        Layers whose weights never arrived would otherwise stay on the meta device; finishing puts their
        previous tensors back, so the model stays runnable (with mixed weights: the caller must not
        sample from it before a complete update).
        """
        try:
            super().update_weights(update_info)
        except BaseException:
            self.finish_weight_update()
            raise

    def receive_weights(self, update_info: UpdateInfo, load_weights: vllm_compat.WeightLoader | None = None) -> None:
        """Receive the announced tensors in order and load them in one `load_weights` call.

        The loader pulls each tensor from a generator that receives it on demand: vLLM's per-call setup is
        paid once instead of once per tensor (on an H200, 474 → 176 ms for 291 tensors), and a layer's
        buffers are still freed as soon as the loader is done with them.
        vLLM 0.24 hands in its own `load_weights` (its worker runs the layerwise reload around this call, or
        hands a kernel-format loader when loading in place: checkpoint names need the model's own loader);
        later releases pass none and call our start/finish hooks instead.
        """
        if self._weights is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine: no weights to receive from")
        load = self.model.load_weights if self._in_place or load_weights is None else load_weights
        received = self._weights.tensors(update_info.tensors())  # each received when the loader asks for it
        load(received)
        unread = [name for name, _ in received]  # still received, so the trainer's round completes
        self._weights.synchronize()
        if unread:
            raise RuntimeError(f"load_weights stopped before {len(unread)} announced tensors, first '{unread[0]}'")

    def receive_adapter(self, update_info: UpdateInfo, directory: Path, write: bool) -> None:
        """Receive a round's LoRA adapter (the policy served as an adapter, `rollout_servers.adapter`) and, with
        `write`, write it into `directory` as PEFT's adapter file, from which vLLM's own LoRA loading reloads it.
        Nothing is loaded into the model here, so no reload session is opened."""
        if self._weights is None:
            raise RuntimeError("adapter update before init_weight_transfer_engine: no weights to receive from")
        received = list(self._weights.tensors(update_info.tensors()))
        self._weights.synchronize()
        if write:  # copies: a backend may hand out views of a buffer that the next round rewrites
            write_adapter_weights({name: tensor.to("cpu", copy=True) for name, tensor in received}, directory)

    def shutdown(self) -> None:
        if self._weights is not None:
            self._weights.close()
            self._weights = None
