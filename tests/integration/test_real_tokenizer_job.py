"""Multi-turn episodes with a tiny model built on Qwen3's real tokenizer (model.tiny.tokenizer=qwen3): vLLM loads
the directory as any Qwen model, and across turns the ids the learner receives are the ids the engine returned,
each turn's request the ids so far, although the sampled turns re-tokenize to other ids: on an engine of the
test's own, and in a whole job (a real job, run beside the other tests)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import load_config
from asyncrl.config.rollout import EngineConfig, RolloutConfig
from asyncrl.metrics import read_metrics
from demo.tiny.build import init_model
from rollout_servers.rewards.builtin import scorer_for
from tests.integration.conftest import _KEPT_ALIVE, ENGINE_CPU_THREADS
from tests.integration.test_k0_matches_reference import consumed_groups
from tests.integration.test_rollout_multi_turn import (LOGPROB_TOLERANCE, MAX_MODEL_LEN, RecordingEngine,
                                                       check_episode_tokens, recomputed_logprobs, run_episode)
from run_helpers import asyncrl, prepare, tiny_job

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EPISODES = 3
# Small and random (no warm start): what is tested is how ids travel, not what the model says.
QWEN3 = "model.tiny.tokenizer=qwen3"
SHAPE = [QWEN3, "model.tiny.hidden_size=64", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
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


def model_turns(trajectory) -> list[list[int]]:
    """The runs of sampled ids (loss mask 1) of a multi-turn trajectory, turn by turn."""
    turns: list[list[int]] = []
    for position, (token, sampled) in enumerate(zip(trajectory.completion_ids, trajectory.loss_mask)):
        if sampled and (position == 0 or not trajectory.loss_mask[position - 1]):
            turns.append([])
        if sampled:
            turns[-1].append(token)
    return turns


def drifts(tokenizer, turn_ids: list[int]) -> bool:
    """Whether re-tokenizing the turn's text gives other ids than were sampled."""
    return tokenizer.encode(tokenizer.decode(turn_ids), add_special_tokens=False) != turn_ids


def test_episodes_on_the_real_tokenizer_train_the_ids_the_engine_returned(qwen3_engine, qwen3_model, loop_runner):
    tokenizer, model, _ = qwen3_model
    drifting = 0
    for seed in range(EPISODES):
        engine = RecordingEngine(qwen3_engine)
        episode = loop_runner.run(run_episode(engine, tokenizer, seed=100 + seed))
        assert episode.finish_reason == "env_done", episode.error
        check_episode_tokens(episode, engine, tokenizer, model)
        drifting += sum(drifts(tokenizer, completion.token_ids) for _, completion in engine.calls)
    assert drifting > 0  # the premise: re-tokenizing the turns' text would have changed the ids


def qwen3_job(_: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """guess_number on a model of its own built on Qwen3's tokenizer (random, no warm start), K = 0, 2 steps: the
    finished run and its run directory. A real job (conftest.py), run beside the other tests."""
    overrides = tiny_job(tmp, 2, QWEN3, "model.warm_start.steps=0", "task.name=guess_number",
                         "task.guess_number.max_guesses=3", "environment.max_turns=3", "buffer.max_staleness=0",
                         "buffer.batch_groups=2", "rollout.sampling.n=2", "validation.every=0",
                         f"rollout.engine.max_model_len={MAX_MODEL_LEN}", f"model.tiny.max_position={MAX_MODEL_LEN}")
    prepare(tmp, overrides)
    return asyncrl("run", *overrides, "run.name=qwen3-turns"), tmp


REAL_JOBS = [qwen3_job]  # run side by side with other modules' jobs (conftest.py)


def test_a_job_on_the_real_tokenizer_trains_the_ids_its_engine_sampled(real_jobs):
    """guess_number (multi-turn whatever the model says: a random policy never calls the calculator's tool), K = 0,
    so step 1 trains samples of version 0, the model on disk: at every trained position the behaviour log-prob, which
    the engine reported for the id it sampled, is that model's log-prob of the trained id."""
    done, tmp_path = real_jobs[qwen3_job].result()
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "runs" / "qwen3-turns"
    first_step = read_metrics(run_dir)[0]
    trajectories = [t for group in consumed_groups(run_dir, first_step) for t in group.trajectories]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert trajectories and max(t.num_turns for t in trajectories) > 1
    for trajectory in trajectories:
        recomputed = recomputed_logprobs(model, trajectory.prompt_ids, trajectory.completion_ids)
        gaps = [abs(a - b) for a, b, m in zip(trajectory.behaviour_logprobs, recomputed, trajectory.loss_mask) if m]
        assert max(gaps) < LOGPROB_TOLERANCE
        assert set(trajectory.token_versions) == {0}
    assert any(drifts(tokenizer, turn) for t in trajectories for turn in model_turns(t))
