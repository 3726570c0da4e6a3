"""vLLM plugin: our weight-transfer engine, registered in every vLLM process via `vllm.general_plugins`.

The worker side of `asyncrl.weight_transfer`: at `init_weight_transfer_engine` it gets the receiving end of the
backend the init request names (it joins the trainer's private gloo/NCCL group, or maps the trainer's CUDA IPC
buffer on the same GPU), and on `update_weights` loads each announced tensor:
- through the model's `load_weights`, pulling each tensor from the receiving end as the loader asks: inside vLLM's
  layerwise reload (started and finished by `start_weight_update` / `finish_weight_update`), or straight into the
  serving parameters where the engine chose to load in place (`vllm_compat.loads_in_place`);
- in one batched copy into the serving parameters (`weight_load_plan`), where the engine loads in place into one
  unsharded model from a receiving end that holds the whole round already (the shared buffer of the ipc backend).
A policy served as a LoRA adapter is received by `receive_adapter` instead, and switched to in the engine core by the
utility the plugin adds there (`rollout_servers.adapter.flip_at_step_boundary`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from asyncrl.parent_death import die_with_spawning_parent
from asyncrl.weight_transfer import BACKEND_NAME, ReceivingEnd, weight_backend
from asyncrl.weight_transfer.protocol import InitInfo, TensorMeta, UpdateInfo
from rollout_servers import vllm_compat
from rollout_servers.server_logs import record_engine_errors
from rollout_servers.vllm_log_filters import drop_expected_warnings
from rollout_servers.weight_load_plan import (
    Layout,
    LoadPaths,
    LoadPlan,
    NamedTensor,
    checked_plan,
    fail_if_unread,
    layout_of,
    unread_after,
    vllm_layers,
)

log = logging.getLogger(__name__)


def register() -> None:
    """Entry point named in pyproject.toml; vLLM calls it in its engine and worker processes."""
    die_with_spawning_parent()  # vLLM's engine core and workers: gone with the server that started them
    drop_expected_warnings()
    record_engine_errors()  # the engine core's fatal error reaches the server's supervisor, not only its stderr
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout_servers.adapter import FLIP_UTILITY, flip_at_step_boundary  # vLLM's LoRA modules: once vLLM is up

    vllm_compat.add_core_utility(FLIP_UTILITY, flip_at_step_boundary)  # the adapter switch between two steps
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
        self._plan: LoadPlan | None = None  # where the batched load copies each tensor, once checked
        self.last_load = LoadPaths(batched=0, load_weights=0)  # how the last update loaded (`weight_load_paths`)

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
        """Receive the announced tensors and load them: in one batched copy where `_whole_round` holds them all, else
        in one `load_weights` call pulling each tensor as it is received.

        vLLM 0.24 hands in its own `load_weights` (its worker runs the layerwise reload around this call, or
        hands a kernel-format loader when loading in place: checkpoint names need the model's own loader);
        later releases pass none and call our start/finish hooks instead.
        """
        if self._weights is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine: no weights to receive from")
        metas = update_info.tensors()
        held = self._whole_round(metas)
        if held is None:
            self._stream(metas, self.model.load_weights if self._in_place or load_weights is None else load_weights)
        else:
            self._load_batched(held, layout_of(metas))

    def _whole_round(self, metas: list[TensorMeta]) -> list[NamedTensor] | None:
        """Every announced tensor at once where the batched load applies: loading in place into a model that is not
        sharded (tensor and pipeline parallel size 1: every loader then copies the whole tensor into one view), from
        a receiving end that holds the round already; None otherwise."""
        unsharded = self.parallel_config.tensor_parallel_size == 1 and self.parallel_config.pipeline_parallel_size == 1
        if not (self._in_place and unsharded):
            return None
        return self._weights.whole_round(metas)

    def _stream(self, metas: list[TensorMeta], load: vllm_compat.WeightLoader) -> None:
        """One `load_weights` call pulling each tensor from a generator that receives it on demand: vLLM's per-call
        setup is paid once instead of once per tensor (on an H200, 474 → 176 ms for 291 tensors), and a layer's
        buffers are still freed as soon as the loader is done with them."""
        unread = unread_after(load, self._weights.tensors(metas))
        self._weights.synchronize()
        fail_if_unread(unread)
        self.last_load = LoadPaths(batched=0, load_weights=len(metas))

    def _load_batched(self, named: list[NamedTensor], layout: Layout) -> None:
        """The planned tensors in one batched copy, the rest through `load_weights`; the plan is resolved and checked
        against `load_weights` on its first round (a new model or a new set of tensors). The round ends once the
        copies from the receiving end are done, failed or not (the learner rewrites the shared buffer next)."""
        try:
            if self._plan is not None and self._plan.fits(self.model, layout):
                self.last_load = self._plan.load(named, self.model.load_weights)
            else:
                self._plan = None  # a check that fails midway leaves none: the next round checks again
                self._plan = checked_plan(self.model, named, layout, self.model.load_weights, vllm_layers())
                self.last_load = self._plan.paths(checked=True)
        finally:
            self._weights.synchronize()

    def receive_adapter(self, update_info: UpdateInfo) -> dict[str, torch.Tensor]:
        """Receive a round's LoRA adapter (the policy served as an adapter, `rollout_servers.adapter`): the announced
        tensors, copied on the receiving end's device (this worker's): a backend may hand out views of a buffer that
        the next round rewrites, and vLLM's LoRA loading scales some tensors in place. Nothing is loaded into the
        model here, so no reload session is opened."""
        if self._weights is None:
            raise RuntimeError("adapter update before init_weight_transfer_engine: no weights to receive from")
        received = list(self._weights.tensors(update_info.tensors()))
        copies = [torch.empty_like(tensor) for _, tensor in received]
        torch._foreach_copy_(copies, [tensor for _, tensor in received])  # a few kernels, not one per tensor
        self._weights.synchronize()  # the copies too: the learner rewrites a shared buffer once this server answers
        return {name: copy for (name, _), copy in zip(received, copies)}

    def shutdown(self) -> None:
        if self._weights is not None:
            self._weights.close()
            self._weights = None


def weight_load_paths(worker: Any) -> dict[str, Any]:
    """How a vLLM worker's last weight update loaded its tensors (`LoadPaths`); run in the worker through vLLM's
    `collective_rpc` by tests and benchmarks (a function sent to the worker needs VLLM_ALLOW_INSECURE_SERIALIZATION)."""
    engine = worker.weight_transfer_engine
    return dataclasses.asdict(engine.last_load)
