"""The policy served as a LoRA adapter (`model.lora`): vLLM runs the base with `enable_lora`, and every request
names one adapter, the policy's, which each weight-sync round replaces without pausing generation.

vLLM holds two adapter slots (`max_loras` 2): the served adapter's, and a free one. A round's adapter tensors travel
like full weights (the learner's weight backend, into the engine's workers), and are staged in the free slot while
the engine goes on generating: each worker receives them on a thread of its own (on a side CUDA stream where the
device has streams; `AdapterReceiver.asyncrl_stage_adapter`, through the plugin's `receive_adapter`), builds vLLM's
`LoRAModel` of them with vLLM's `LoRAModel.from_lora_tensors` and the arguments vLLM's worker derives for a file
(`build_adapter`), and writes its weights into the free slot's buffers, which no request reads. Then one call into the
engine core, between two of its steps (`flip_at_step_boundary`, added to vLLM's EngineCore by the plugin), has every
worker point the policy's adapter id at that slot (`flip_slots`: the old slot becomes the free one) and answers how
many tokens each request had sampled by then, batches still in flight included (vLLM's placeholders for them): those
tokens are the old adapter's, every later one the new adapter's. Generation stands still only for that call; no
request waits for the step in flight, as a pause would. No file is written or read, and the adapter never leaves the
device. Every worker stages and flips (each tensor-parallel rank keeps its slice: vLLM's layers slice the whole
adapter on `set_lora`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

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
ADAPTER_SLOTS = 2  # vLLM's max_loras: the served adapter's slot and the free one the next round is staged in
STAGE_POLL_S = 0.001  # between asks whether every worker holds the round's adapter (each a utility call between steps)


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

    async def stage(self, llm: AsyncLLM, update_info: dict[str, Any], deadline_s: float) -> dict[str, float]:
        """Have every worker receive the round's adapter (announced by `update_info`) into its free slot while the
        engine generates; returns once all of them hold it, with the slowest worker's seconds (`adapter_receive`,
        `adapter_load`). Raises the first worker's error, or when `deadline_s` passed first."""
        await llm.collective_rpc(STAGE_METHOD, args=(update_info, self._settings))
        deadline = time.monotonic() + deadline_s
        while None in (answers := await llm.collective_rpc(STAGED_METHOD)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the adapter was not staged in every worker within {deadline_s:.0f}s")
            await asyncio.sleep(STAGE_POLL_S)
        return {phase: max(answer[phase] for answer in answers) for phase in answers[0]}

    async def flip(self, llm: AsyncLLM) -> Flip:
        """Serve the staged adapter from the engine's next step on (one call between two of its steps)."""
        flipped = await llm.engine_core.call_utility_async(FLIP_UTILITY)
        self._loaded = True
        return Flip(flipped["sampled"], flipped["seconds"])


@dataclass
class Flip:
    """What the engine core answered when it switched adapters."""

    sampled: dict[str, int]  # tokens each request it held had sampled under the old adapter (by vLLM's request id)
    seconds: float  # how long the engine core stood still for the switch


class AdapterReceiver:
    """Mixed into vLLM's worker class (`worker_extension_cls`) when the policy is served as an adapter."""

    _asyncrl_staging: AdapterStaging | None = None  # the round's adapter being staged, or staged and not yet served

    def asyncrl_stage_adapter(self, update_info: dict[str, Any], settings: dict[str, Any]) -> None:
        """Start receiving the announced adapter into the free slot, on a thread beside generation."""
        if self._asyncrl_staging is not None and self._asyncrl_staging.running():
            raise RuntimeError("the previous round's adapter is still being received")
        engine = self.weight_transfer_engine
        self._asyncrl_staging = AdapterStaging(lambda: engine.receive_adapter(engine.parse_update_info(update_info)),
                                               self.model_runner.lora_manager, settings)

    def asyncrl_adapter_staged(self) -> dict[str, float] | None:
        """None while the adapter is being staged; then its seconds, or the error that stopped it."""
        if self._asyncrl_staging is None:
            raise RuntimeError("no adapter is being staged")
        return self._asyncrl_staging.seconds()

    def asyncrl_flip_adapter(self) -> None:
        """Serve the staged adapter: point the policy's adapter id at its slot."""
        staging, self._asyncrl_staging = self._asyncrl_staging, None
        if staging is None or staging.seconds() is None:
            raise RuntimeError("no staged adapter to serve")
        flip_slots(self.model_runner.lora_manager._adapter_manager, staging.lora, staging.slot)


class AdapterStaging:
    """One round's adapter received, built into vLLM's `LoRAModel` and written into the free slot, on a thread of its
    own beside generation (on a CUDA device, on a stream of its own, done before the thread ends)."""

    def __init__(self, receive: Callable[[], dict[str, torch.Tensor]], lora_manager: Any,
                 settings: dict[str, Any]) -> None:
        self.lora: Any = None  # vLLM's LoRAModel, once built
        self.slot = -1  # the slot its weights were written into
        self._seconds: dict[str, float] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(receive, lora_manager, settings),
                                        name="asyncrl-adapter-staging", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def seconds(self) -> dict[str, float] | None:
        """None while running; then `adapter_receive` and `adapter_load` seconds, or the error raised."""
        if self._thread.is_alive():
            return None
        if self._error is not None:
            raise self._error
        return self._seconds

    def _run(self, receive: Callable[[], dict[str, torch.Tensor]], lora_manager: Any, settings: dict[str, Any]) -> None:
        try:
            with _side_stream(lora_manager.device) as done, vllm_compat.adapter_swap_syncs():
                started = time.perf_counter()
                tensors = receive()
                received = time.perf_counter()
                self.lora = build_adapter(lora_manager, tensors, settings)
                self.slot = free_slot(lora_manager._adapter_manager)
                write_slot(lora_manager._adapter_manager, self.lora, self.slot)
                done()
            self._seconds = {"adapter_receive": received - started, "adapter_load": time.perf_counter() - received}
        except BaseException as error:  # kept for the server's next ask, which raises it
            self._error = error


@contextlib.contextmanager
def _side_stream(device: torch.device) -> Iterator[Callable[[], None]]:
    """A CUDA stream for the staging thread's copies, after everything already queued on the device's default stream
    (a slot freed by the last switch is read by no batch then); what it yields waits for the stream's work. Elsewhere
    copies are done when they return."""
    if device.type != "cuda":
        yield lambda: None
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.default_stream(device))
    with torch.cuda.stream(stream):
        yield stream.synchronize


def build_adapter(lora_manager: Any, tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> Any:
    """vLLM's `LoRAModel` for a worker's LoRA manager (vLLM's `WorkerLoRAManager`) of `tensors` (PEFT's names, on the
    worker's device, the caller's to give away: vLLM scales some in place) and `settings` (PEFT's adapter config),
    packed modules merged as the manager serves them.

    Built as vLLM's worker builds one from a file (`_load_adapter`: PEFTHelper of the config, checked against the
    engine's LoRA config; the modules the model serves LoRA on; its name mapper and skipped prefixes; the LoRA dtype and
    vocabulary size), with vLLM's `LoRAModel.from_lora_tensors` on the worker's own device, so nothing is pinned and
    `set_lora` copies device to device."""
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
    manager._create_merged_loras_inplace(lora)  # q, k and v into qkv_proj's, as vLLM does when it adds an adapter
    return lora


def free_slot(manager: Any) -> int:
    """The slot no adapter id points at (vLLM's `lora_index_to_id`): the one the next adapter is staged in."""
    if None not in manager.lora_index_to_id:
        raise RuntimeError(f"no free adapter slot among {manager.lora_index_to_id} (the engine needs "
                           f"max_loras={ADAPTER_SLOTS})")
    return manager.lora_index_to_id.index(None)


def write_slot(manager: Any, lora: Any, slot: int) -> None:
    """Copy `lora`'s weights into `slot` of every LoRA layer of the manager's model (zeros where it has none)."""
    for module_name, module in manager.modules.items():
        weights = manager._get_lora_layer_weights(lora, module_name)
        if weights is None:
            module.reset_lora(slot)
        else:
            module.set_lora(slot, weights.lora_a, weights.lora_b)


def flip_slots(manager: Any, lora: Any, slot: int) -> None:
    """Make `lora`, written into `slot`, the policy's adapter in vLLM's LoRA manager: its id points at that slot and
    the slot it pointed at is free. The batches already launched keep the old slot's indices and weights; the next
    step recomputes the indices (vLLM 0.24 does so only for a new mapping, hence the cleared one)."""
    slots = manager.lora_index_to_id
    if POLICY_ADAPTER_ID in slots:
        slots[slots.index(POLICY_ADAPTER_ID)] = None
    slots[slot] = POLICY_ADAPTER_ID
    manager._registered_adapters[POLICY_ADAPTER_ID] = lora
    manager._active_adapters[POLICY_ADAPTER_ID] = None
    manager._last_mapping = None


def flip_at_step_boundary(core: Any) -> dict[str, Any]:
    """Run in vLLM's engine core between two of its steps (added to its EngineCore as `FLIP_UTILITY` by the plugin):
    every worker serves its staged adapter from the next step on, and the answer says how many tokens each request had
    sampled before it, the tokens of batches still in flight (vLLM's placeholders) included: they were launched with
    the old adapter."""
    started = time.perf_counter()
    core.model_executor.collective_rpc(FLIP_METHOD)
    sampled = {request_id: request.num_output_tokens + request.num_output_placeholders
               for request_id, request in core.scheduler.requests.items()}
    return {"sampled": sampled, "seconds": time.perf_counter() - started}


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


STAGE_METHOD = AdapterReceiver.asyncrl_stage_adapter.__name__  # what the engine asks its workers to run
STAGED_METHOD = AdapterReceiver.asyncrl_adapter_staged.__name__
FLIP_METHOD = AdapterReceiver.asyncrl_flip_adapter.__name__
FLIP_UTILITY = "asyncrl_flip_adapter"  # the engine core's method that runs `flip_at_step_boundary`
WORKER_EXTENSION = f"{AdapterReceiver.__module__}.{AdapterReceiver.__qualname__}"  # vLLM's worker_extension_cls
