"""The token budget of one engine step against `rollout.max_inflight`: vLLM refuses a budget below its number of
sequences (each running sequence decodes one token a step), so a job with more than 2048 samples in flight, such as
128 prompts x 8 at K = 2, must raise it or its engine never starts."""

from __future__ import annotations

import pytest
from vllm.config import SchedulerConfig

from asyncrl.config.rollout import EngineConfig
from rollout_servers.engine_args import engine_args, step_token_budget


@pytest.mark.parametrize("max_inflight, budget", [(8, None), (2048, None), (2049, 2049), (3072, 3072)])
def test_the_budget_is_vllms_own_until_the_sequences_outnumber_it(max_inflight, budget):
    assert step_token_budget(max_inflight) == budget


def test_vllm_takes_the_engine_arguments_of_3072_sequences_in_flight(tmp_path):
    args = engine_args(str(tmp_path), EngineConfig(), 3072)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (3072, 3072)
    SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=1024, is_encoder_decoder=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):  # what the engine met with vLLM's default
        SchedulerConfig(max_num_seqs=3072, max_num_batched_tokens=2048, max_model_len=1024, is_encoder_decoder=False)


def test_cuda_graphs_reach_the_sequences_asked_for_and_stay_vllms_own_otherwise(tmp_path):
    """vLLM captures graphs for steps of at most 512 sequences by default: a server kept full at 1,536 in flight
    would decode its steps without one (rollout.engine.cudagraph_max_sequences)."""
    asked = engine_args(str(tmp_path), EngineConfig(enforce_eager=False, cudagraph_max_sequences=1536), 1536)
    assert asked.compilation_config.max_cudagraph_capture_size == 1536
    own = engine_args(str(tmp_path), EngineConfig(enforce_eager=False), 1536)
    assert own.compilation_config.max_cudagraph_capture_size is None  # vLLM then picks min(2 x max_num_seqs, 512)


def test_graph_sizes_on_an_eager_engine_are_refused_by_name():
    from asyncrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.engine.cudagraph_max_sequences: needs rollout.engine.enforce_eager"):
        load_config("configs/quickstart.yaml", ["rollout.engine.cudagraph_max_sequences=1024"])
    assert load_config("configs/gpu_longtail.yaml",
                       ["rollout.engine.cudagraph_max_sequences=1536"]).rollout.engine.cudagraph_max_sequences == 1536
