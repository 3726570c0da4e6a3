"""Loading the policy as an FSDP2-sharded module, and gathering its full weights back."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method
from transformers import AutoModelForCausalLM

from asyncrl.config import AsyncRLConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.sections import LoraConfig
from asyncrl.weight_transfer.backends import IPC, weight_backend
from asyncrl.weight_transfer.sender import materialised
from learner.distributed import World
from learner.maths import attention
from learner.maths.logprobs import SCORING_METHOD, attach_scoring
from learner.policy.activation_checkpointing import AUTO, apply_activation_checkpointing, attach_switch, checkpointing_for_device
from learner.policy.lora import AdaptersOff, adapter_tensors, add_adapters, has_adapters

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(model_path: str, dtype: str, settings: LearnerConfig, world: World,
                lora: LoraConfig | None = None) -> torch.nn.Module:
    """The HF causal LM at `model_path` in `dtype`, sharded with fully_shard per decoder layer and at the root. With
    `lora` enabled, only its adapters are in `dtype` and train; the base is frozen in `frozen_base_dtype`."""
    def pretrained(weights_dtype: torch.dtype) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=weights_dtype,
                                                    attn_implementation=attention.register())

    return build_policy(pretrained, dtype, settings, world, lora)


def build_policy(weights: Callable[[torch.dtype], torch.nn.Module], dtype: str, settings: LearnerConfig, world: World,
                 lora: LoraConfig | None = None) -> torch.nn.Module:
    """The policy from the model that `weights` builds in a given dtype (loaded with `attention.register()`'s
    implementation): in `dtype`, or with `lora` enabled a base frozen in `frozen_base_dtype` carrying `lora`'s
    adapters in `dtype`; then sharded (`shard_policy`). Separate from `load_policy` so that a benchmark's random
    weights become a policy exactly as a checkpoint's do."""
    with_adapters = lora is not None and lora.enabled
    weights_dtype = frozen_base_dtype(dtype, settings, world) if with_adapters else dtype
    model = weights(DTYPES[weights_dtype])
    if with_adapters:
        add_adapters(model, _decoder_layers(model), lora, DTYPES[dtype])
    return shard_policy(model, settings, world)


def frozen_base_dtype(master_dtype: str, settings: LearnerConfig, world: World) -> str:
    """The dtype of LoRA's frozen base: bfloat16 where the learner computes in bfloat16 (mixed precision on a GPU),
    since a weight that never moves loses nothing to it and each pass would cast it anyway; else `master_dtype`."""
    return "bfloat16" if settings.mixed_precision and world.device.type == "cuda" else master_dtype


def load_reference(config: AsyncRLConfig, world: World, policy: torch.nn.Module) -> torch.nn.Module | None:
    """The frozen reference model of `algorithm.use_reference` (None without it): with LoRA and no
    `algorithm.reference_path`, `policy`'s base with its adapters off; else a model in `model.dtype`, sharded
    like the policy, that only runs forward passes (no activations kept, no optimizer state)."""
    algorithm = config.algorithm
    if not algorithm.use_reference:
        return None
    if config.model.lora.enabled and not algorithm.reference_path:
        return AdaptersOff(policy)
    settings = replace(config.learner, activation_checkpointing="none", cpu_offload=algorithm.reference_cpu_offload)
    return load_policy(algorithm.reference_path or config.model.path, config.model.dtype, settings, world).requires_grad_(False)


def shard_policy(model: torch.nn.Module, settings: LearnerConfig, world: World) -> torch.nn.Module:
    """`model` (loaded with `attention.register()`'s implementation) on this rank's device: activation
    checkpointing and `torch.compile` per decoder layer as configured, then sharded with fully_shard per
    decoder layer and at the root, with `score_targets` run under FSDP like `forward`. Checkpointing `auto`
    is chosen later, by `learner.policy.memory` (none until then). The shards live on the world's device: FSDP's own default
    mesh follows the machine's accelerator instead, which put a CPU world's model on the GPU of a CUDA host."""
    attach_scoring(model)
    model.to(world.device)
    layers = _decoder_layers(model)
    checkpointing = checkpointing_for_device(settings.activation_checkpointing, world.device)
    if checkpointing != settings.activation_checkpointing:
        log.info("learner.activation_checkpointing=%s on %s: %s (no GPU memory to save)", AUTO, world.device.type,
                 checkpointing)
    attach_switch(model, apply_activation_checkpointing(layers, checkpointing))
    if settings.compile:
        for layer in layers:
            layer.compile(dynamic=True)
    sharding = {"mesh": init_device_mesh(world.device.type, (world.size,)),
                "mp_policy": _mixed_precision(settings, world), "offload_policy": _offload(settings, world)}
    for layer in layers:
        fully_shard(layer, **sharding)
    fully_shard(model, **sharding)
    register_fsdp_forward_method(model, SCORING_METHOD)
    return model


def served_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What the rollout servers load, as live (sharded) tensors: with LoRA the adapters alone, under their names in
    PEFT's adapter files; else every weight by its state-dict name."""
    return adapter_tensors(model) if has_adapters(model) else list(model.state_dict(keep_vars=True).items())


def full_weights_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the unsharded served weights in `dtype`, a tied weight counted once (what `full_weights` holds)."""
    unique = {id(tensor): tensor for _, tensor in served_tensors(model)}
    return sum(tensor.numel() for tensor in unique.values()) * dtype.itemsize


def served_weights_device(config: AsyncRLConfig, model: torch.nn.Module, world: World) -> torch.device:
    """Where the served weights are gathered for the rollout servers, and kept between rounds on rank 0: the
    learner's GPU when they are sent from there (NCCL, CUDA IPC), fit `rollout.weight_sync.staging_bytes` and no
    older versions are kept beside them (`buffer.study_lag_versions`); else CPU memory."""
    sync = config.rollout.weight_sync
    sends_from_gpu = world.device.type == "cuda" and weight_backend(sync.backend).kind.device_type == "cuda"
    if sends_from_gpu and not config.buffer.study_lag_versions:
        if full_weights_bytes(model, DTYPES[config.model.dtype]) <= sync.staging_bytes:
            return world.device
    return torch.device("cpu")


def weights_held_for_servers(config: AsyncRLConfig, model: torch.nn.Module, world: World, servers_beside: int) -> int:
    """Bytes of served weights this rank holds on its GPU between syncs: on rank 0, the gathered copy where
    `served_weights_device` keeps it there, and the CUDA IPC buffer that `servers_beside` servers on its GPU map
    (docs/weight_sync.md); nothing on the other ranks."""
    if not world.is_main or world.device.type != "cuda":
        return 0
    gathered = served_weights_device(config, model, world).type == "cuda"
    shared = servers_beside > 0 and weight_backend(config.rollout.weight_sync.backend, shared_gpu=True) is IPC
    return (gathered + shared) * full_weights_bytes(model, DTYPES[config.model.dtype])


def full_weights(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, keep: bool,
                 pinned: PinnedWeights | None = None) -> list[tuple[str, torch.Tensor]]:
    """Unsharded served weights (`served_tensors`: with LoRA the adapters) in `dtype` on `device`, in state-dict
    order; a tied weight is gathered once and listed under each of its names. Gathering is a collective: every
    rank calls this, and ranks with `keep` False take part and get an empty list. Each weight is cast as soon as
    it is gathered, so a learner that keeps float32 weights never holds a whole float32 copy. The result is a
    copy: training on does not change it (a late server caught up with it gets the version it was sent as). With
    `pinned` (weights of a GPU learner gathered into CPU memory) the copies are its reused page-locked tensors,
    valid until the next call with it."""
    weights: list[tuple[str, torch.Tensor]] = []
    gathered: dict[int, torch.Tensor | None] = {}
    for name, tensor in served_tensors(model):
        if id(tensor) not in gathered:
            full = materialised(tensor.detach())  # a shard's all-gather: every rank takes part
            gathered[id(tensor)] = _kept_copy(name, full, dtype, device, pinned) if keep else None
        if keep:
            weights.append((name, gathered[id(tensor)]))
    if keep and pinned is not None:
        pinned.wait()
    return weights


def _kept_copy(name: str, full: torch.Tensor, dtype: torch.dtype, device: torch.device,
               pinned: PinnedWeights | None) -> torch.Tensor:
    if pinned is not None and full.is_cuda and device.type == "cpu":
        return pinned.copy(name, full.to(dtype))  # cast where the weight is, then one copy over the bus
    return full.to(device=device, dtype=dtype, copy=True)  # copy: never the live weight


class PinnedWeights:
    """Page-locked CPU tensors that receive the gathered weights round after round. A copy from the GPU into
    pinned memory runs at the bus's speed without blocking the host, and reusing the tensors spares mapping
    and faulting in a fresh model-sized allocation each round (a 7B-shaped model gathered into new pageable
    memory took 19.7 s per round on an H200 host, see docs/benchmarks.md)."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._copied_on: set[torch.cuda.Stream] = set()

    def copy(self, name: str, source: torch.Tensor) -> torch.Tensor:
        """`source` (on a GPU) copied into `name`'s pinned tensor, asynchronously: `wait` before reading it."""
        target = self._tensors.get(name)
        if target is None or target.shape != source.shape or target.dtype != source.dtype:
            target = self._tensors[name] = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        target.copy_(source, non_blocking=True)
        self._copied_on.add(torch.cuda.current_stream(source.device))
        return target

    def wait(self) -> None:
        """Until every copy made since the last wait has landed."""
        for stream in self._copied_on:
            stream.synchronize()
        self._copied_on.clear()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected decoder layers at model.model.layers to shard")
    return list(layers)


def _mixed_precision(settings: LearnerConfig, world: World) -> MixedPrecisionPolicy:
    if settings.mixed_precision and world.device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _offload(settings: LearnerConfig, world: World) -> OffloadPolicy:
    """GPU: with `cpu_offload`, sharded weights, gradients and optimizer state live in CPU memory (the optimizer
    steps there); FSDP copies each layer's weights to the GPU for its forward and backward."""
    if settings.cpu_offload and world.device.type == "cuda":
        return CPUOffloadPolicy()
    return OffloadPolicy()
