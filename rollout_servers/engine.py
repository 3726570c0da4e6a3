"""`RolloutEngine`: one in-process vLLM `AsyncLLM` that samples with per-token policy versions and takes
in-flight weight updates (pause in keep mode, receive, resume) from the learner.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Any

import torch
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM

from asyncrl.config.rollout import RolloutConfig, SamplingConfig
from asyncrl.config.sections import LoraConfig
from asyncrl.parent_death import forked_children_die_with_parent
from rollout_servers import vllm_compat
from rollout_servers.adapter import ServedAdapter
from rollout_servers.completion import Completion, TokenStream, TokensSoFar
from rollout_servers.engine_args import engine_args, engine_process_env, forks_engine_core, sampling_params
from rollout_servers.row_sampling import sample_seeds
from rollout_servers.sample_slots import SampleDone, reporting_done
from rollout_servers.work_tally import count_tokens

log = logging.getLogger(__name__)
STAGE_DEADLINE_ROUNDS = 2  # an adapter's staging (receive, build, write) may take this many weight-sync deadlines
WARM_UP_REQUEST_ID = "asyncrl-warm-up"  # the one request a started engine sends itself (`_send_warm_up`)


def _prefix_cache_salt(version: int) -> str:
    """Salt of a new request's prefix-cache keys: the policy version it starts under.

    An update loads new weights but leaves vLLM's prefix cache holding key/values computed with the old
    ones; a new request must not reuse them, or its log-probs would be those of neither policy. Requests
    in flight keep their own cache (keep-mode pause), and requests started under one version still share
    prompt blocks (a group's samples, for one).
    """
    return f"asyncrl-policy-v{version}"


@contextlib.contextmanager
def _naming_lora_when_start_fails(lora_on: bool) -> Iterator[None]:
    """vLLM refuses adapters for a model it cannot serve them with only deep inside its engine's start; say which
    key asked for them."""
    try:
        yield
    except Exception as error:
        if not lora_on:
            raise
        raise RuntimeError(f"vLLM failed to start with model.lora.enabled=true ({error}); check above whether it "
                           "serves LoRA adapters for this model and model.lora.target_modules") from error


async def _send_warm_up(llm: AsyncLLM, sampling: SamplingConfig) -> None:
    """Send one request for one token, sampled as the job samples (with its log-prob), and let it finish on its own.
    vLLM compiles parts of its sampler at the first request that uses them (torch.compile of the log-prob ranking,
    `batched_count_greater_than`), which its own start never does: the job's first batch paid for it, 1.8 s of a tiny
    engine's first request on a 2-core CPU against 0.1 s for the next. Sent now, the engine core compiles while this
    process goes on (the synchronous reference loads its policy, a server joins weight sync); requests sent later
    queue behind it."""
    params = sampling_params(dataclasses.replace(sampling, max_tokens=1))
    await llm.add_request(WARM_UP_REQUEST_ID, {"prompt_token_ids": [0]}, params)


class WeightSyncError(RuntimeError):
    """Joining the weight-sync group or applying an update failed (the message says which and why)."""



def _prepare_forked_core(cpu_threads: int) -> None:
    """What a spawned engine core gets by starting afresh, for the core this process is about to fork."""
    forked_children_die_with_parent()  # from the fork on; our plugin asks again once the core loads it
    vllm_compat.load_plugins_again_when_forked()  # as a spawned core does: after the core's logging setup
    if cpu_threads:  # a spawned core reads OMP_NUM_THREADS as it starts; a forked one keeps this process's count
        torch.set_num_threads(cpu_threads)

class RolloutEngine:
    """Generation with behaviour log-probs and token versions; weight updates that keep requests alive."""

    def __init__(self, llm: AsyncLLM, config: RolloutConfig, version: int, adapter: ServedAdapter | None = None) -> None:
        self._llm = llm
        self._config = config
        self._version = version
        self._adapter = adapter  # the policy served as a LoRA adapter (model.lora), else None: updates load weights
        self._load_in_place = vllm_compat.loads_in_place(config.weight_sync.load_in_place, llm.model_config)
        self._streams: dict[str, TokenStream] = {}
        self._on_base: set[str] = set()  # requests sent before the first adapter: the base samples them to their end
        self._tokens_sampled = 0
        self._update_lock = asyncio.Lock()
        self._needs_catch_up = False

    @classmethod
    async def start(cls, model_path: str, config: RolloutConfig, version: int = 0,
                    lora: LoraConfig | None = None, gpu_memory_gib: float = 0.0,
                    process_is_fresh: bool = False) -> RolloutEngine:
        """Start vLLM on `model_path`, whose weights are policy `version`; with `lora` enabled, the policy is served as
        an adapter on that base, which each update replaces; its memory is its share of `gpu_memory_gib` per GPU (the
        job's budget, `run.gpu_memory_gib`; 0: the whole card). `process_is_fresh`: this process has run no torch
        computation, so on CPU the engine core may be forked from it (`forks_engine_core`). Call from the serving
        event loop."""
        started = time.perf_counter()
        adapter = ServedAdapter(lora) if lora is not None and lora.enabled else None
        fork_core = forks_engine_core(config.engine, process_is_fresh)
        if fork_core:
            _prepare_forked_core(config.engine.cpu_threads)
        with engine_process_env(config.engine), _naming_lora_when_start_fails(adapter is not None):
            llm = vllm_compat.start_llm(engine_args(model_path, config.engine, config.max_inflight, lora,
                                                    gpu_memory_gib), fork_core)
        await vllm_compat.label_weights(llm, version)
        await _send_warm_up(llm, config.sampling)
        log.info("vLLM engine on %s started in %.1fs (version %d%s)", model_path, time.perf_counter() - started, version,
                 ", serving the policy as a LoRA adapter" if adapter else "")
        return cls(llm, config, version, adapter)

    @property
    def llm(self) -> AsyncLLM:
        """vLLM's engine behind this one, for what vLLM offers beyond generation (e.g. `collective_rpc` on its
        workers); generating or updating weights through it bypasses the token versions kept here."""
        return self._llm

    @property
    def current_version(self) -> int:
        """Policy version of the weights tokens are sampled with now."""
        return self._version

    @property
    def needs_catch_up(self) -> bool:
        """True after a failed update: the engine stays paused until a complete update succeeds."""
        return self._needs_catch_up

    @property
    def tokens_sampled(self) -> int:
        """Completion tokens of every finished request so far, whatever asked for it (rollouts, agent turns,
        chat sessions, validation)."""
        return self._tokens_sampled

    @property
    def inflight_requests(self) -> int:
        """Requests in the engine now."""
        return len(self._streams)

    def inflight_tokens(self) -> dict[str, int]:
        """Completion tokens sampled so far per unfinished request (vLLM's count where it can tell, which
        covers requests that return their final output only); 0 for a request vLLM has not taken in yet."""
        return {
            request_id: vllm_compat.tokens_sampled(self._llm, request_id) or 0 for request_id in self._streams
        }

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig | None = None,
        *,
        seed: int | None = None,
        request_id: str | None = None,
        on_tokens: TokensSoFar | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> Completion:
        """Sample one completion of `prompt_ids` (config sampling unless `sampling` is given). It runs to its end
        through weight updates, whatever their number: each token carries the version that sampled it.

        `on_tokens`: awaited with the ids and log-probs sampled so far as they grow (a streamed chat
        reply); an exception it raises aborts the request and comes out of this call.
        `structured_outputs`: a grammar the completion must follow (a chat request's forced tool call); the
        log-probs are then vLLM's after the grammar's mask, those of the distribution that sampled."""
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params(sampling or self._config.sampling, seed, stream=on_tokens is not None,
                                 structured_outputs=structured_outputs)
        stream = self._streams[request_id] = TokenStream(request_id, list(prompt_ids), self._version,
                                                         engine_spans=self._adapter is None)
        prompt = {"prompt_token_ids": list(prompt_ids), "cache_salt": _prefix_cache_salt(self._version)}
        try:
            await self._read(stream, prompt, params, on_tokens)  # a caller's cancellation makes vLLM abort it
        finally:
            del self._streams[request_id]
            self._on_base.discard(request_id)
        return stream.completion()

    async def _read(self, stream: TokenStream, prompt: dict[str, Any], params: Any,
                    on_tokens: TokensSoFar | None) -> None:
        # closed explicitly so that a failing `on_tokens` (a chat client gone) aborts the request at once
        lora_request = self._adapter.request if self._adapter is not None else None
        if self._adapter is not None and lora_request is None:
            self._on_base.add(stream.request_id)
        async with contextlib.aclosing(self._llm.generate(prompt, params, stream.request_id,
                                                          lora_request=lora_request)) as outputs:
            try:
                async for output in outputs:
                    stream.absorb(output)
                    if on_tokens is not None:
                        await on_tokens(stream.token_ids, stream.logprobs)
            except asyncio.CancelledError:  # cut (its server stops): read what it sampled before vLLM forgets it
                count_tokens(vllm_compat.tokens_sampled(self._llm, stream.request_id) or len(stream.token_ids))
                raise
        self._tokens_sampled += len(stream.token_ids)
        count_tokens(len(stream.token_ids))

    async def generate_group(
        self, prompt_ids: list[int], sampling: SamplingConfig | None = None, *, seed: int | None = None,
        on_sample_done: SampleDone | None = None,
    ) -> list[Completion]:
        """`sampling.n` completions of one prompt, each its own request (its own token versions);
        `on_sample_done` is told as each one finishes."""
        sampling = sampling or self._config.sampling
        samples = (reporting_done(self.generate(prompt_ids, sampling, seed=s), on_sample_done)
                   for s in sample_seeds(seed, sampling.n))
        return list(await asyncio.gather(*samples))

    async def join_weight_sync(self, init_info: dict[str, Any]) -> None:
        """Join the learner's weight-sync group (`asyncrl.weight_transfer.init_info_for`); bounded by its deadline."""
        started = time.perf_counter()
        try:
            request = vllm_compat.init_request(init_info | {"load_in_place": self._load_in_place})
            await self._llm.init_weight_transfer_engine(request)
        except Exception as error:
            raise WeightSyncError(
                f"joining the weight-sync group at {init_info.get('host')}:{init_info.get('port')} failed after "
                f"{time.perf_counter() - started:.1f}s (deadline {init_info.get('timeout_s')}s): {error}"
            ) from error
        log.info("joined the weight-sync group in %.2fs (%s)", time.perf_counter() - started,
                 "loading in place" if self._load_in_place else "layerwise reload")

    async def update_weights(self, update_info: dict[str, Any], version: int) -> float:
        """Receive the learner's broadcast of `update_info`'s tensors as policy `version`.

        Requests in flight are kept (with their KV cache); tokens sampled after this returns carry `version`.
        Returns the seconds generation stood still: from pause to resume, or for an adapter its switch.
        On failure `WeightSyncError` is raised. A failed load leaves the engine paused (`needs_catch_up`): its weights
        may be mixed, so it must not sample until an update succeeds. A failed adapter goes on serving the last one.
        """
        async with self._update_lock:
            if self._adapter is not None:
                return await self._switch_adapter(update_info, version)
            started = time.perf_counter()
            await vllm_compat.pause_keeping_requests(self._llm)
            paused_at = time.perf_counter()
            try:
                await self._load(update_info, version)
            except Exception as error:
                self._needs_catch_up = True
                message = f"weight update to version {version} failed; engine stays paused: {error}"
                raise WeightSyncError(message) from error
            received_s = time.perf_counter() - paused_at
            self._mark_version_change(version, self.inflight_tokens())
            self._version, self._needs_catch_up = version, False
            await self._llm.resume_generation()
            seconds = time.perf_counter() - started
        log.info("weights updated to version %d; paused %.3fs (pausing %.3fs, receiving %.3fs)", version, seconds,
                 paused_at - started, received_s)
        return seconds

    async def _switch_adapter(self, update_info: dict[str, Any], version: int) -> float:
        """The policy served as an adapter (`rollout_servers.adapter`): staged in the free slot while the engine
        generates, then served from the engine's next step on, with no pause. Returns the seconds the switch held the
        engine core."""
        started = time.perf_counter()
        try:
            deadline_s = STAGE_DEADLINE_ROUNDS * self._config.weight_sync.timeout_s
            staged = await self._adapter.stage(self._llm, update_info, deadline_s)
            staged_at = time.perf_counter()
            flip = await self._adapter.flip(self._llm)
        except Exception as error:
            raise WeightSyncError(f"adapter update to version {version} failed; the engine goes on serving version "
                                  f"{self._version}: {error}") from error
        await vllm_compat.outputs_counted(self._llm)  # requests finished before the switch: their final outputs read
        # a request that names no adapter goes on with the base, policy version 0 (PEFT starts B at zero)
        naming_the_adapter = [request_id for request_id in self._streams if request_id not in self._on_base]
        self._mark_version_change(version, vllm_compat.core_counts_by_request(self._llm, flip.sampled,
                                                                               naming_the_adapter))
        self._version = version
        log.info("adapter updated to version %d; engine held %.4fs (staged in %.3fs beside generation: receiving "
                 "%.3fs, building and writing %.3fs; switch call %.3fs)", version, flip.seconds, staged_at - started,
                 staged["adapter_receive"], staged["adapter_load"], time.perf_counter() - staged_at)
        return flip.seconds

    async def weight_checksums(self) -> list[dict[str, str]] | None:
        """Per-worker checksums of the loaded weights (to prove servers hold what the learner sent)."""
        return await vllm_compat.weight_checksums(self._llm)

    def shutdown(self) -> None:
        """Stop vLLM's processes. The AsyncLLM object is kept: collecting it early can block in zmq's
        context teardown (seen here as a hang at the end of the test session)."""
        self._llm.shutdown()

    def _mark_version_change(self, version: int, sampled: dict[str, int | None]) -> None:
        """Tokens each request in flight sampled so far (`sampled`) belong to the old weights; None: a request that
        finished under them."""
        for request_id, count in sampled.items():
            if count is not None:
                self._streams[request_id].version_changed(count, version)

    async def _load(self, update_info: dict[str, Any], version: int) -> None:
        await vllm_compat.start_update(self._llm, self._load_in_place)
        await self._llm.update_weights(vllm_compat.update_request(update_info))
        await vllm_compat.finish_update(self._llm, version)
