"""LoRA adapters on the learner's policy (learner/policy/lora.py), without FSDP: what trains, what the adapters' names are
in PEFT's files, the base with the adapters off, dropout in training passes only, and the errors at start that
name the key."""

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file

from asyncrl.config import ConfigError, load_config
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.sections import LoraConfig
from learner.distributed import World
from learner.maths.logprobs import target_logprobs
from learner.policy.lora import (AdaptersOff, adapter_dropout, adapter_tensors, add_adapters, adapters_disabled,
                          is_adapter_weight, lora_layers, peft_config)
from learner.policy.policy_model import frozen_base_dtype
from policy_helpers import tiny_policy

TOKENS = torch.tensor([[3, 9, 14, 27, 5, 41, 8, 19]])  # [1, T]
ATTENTION = torch.ones_like(TOKENS)
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def adapted(lora: LoraConfig = LORA, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    model = tiny_policy()
    return add_adapters(model, list(model.model.layers), lora, dtype)


def scores(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return target_logprobs(model, TOKENS, ATTENTION, with_entropy=False)[0]  # [1, T-1]


def move_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """Give every B a non-zero value (PEFT starts it at zero), as training would."""
    generator = torch.Generator().manual_seed(seed)
    for layer in lora_layers(model):
        weight = layer.lora_B["default"].weight
        weight.data = torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * 0.5


def test_only_the_adapters_train_and_the_policy_starts_as_the_base():
    model = adapted()
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    # 2 layers x 3 targets x (A, B)
    assert len(trained) == 12 and all(is_adapter_weight(name) for name in trained)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert torch.equal(scores(model), scores(tiny_policy()))


def test_adapters_take_the_master_dtype_on_a_base_of_another():
    model = tiny_policy(dtype=torch.bfloat16)
    add_adapters(model, list(model.model.layers), LORA, torch.float32)
    dtypes = {is_adapter_weight(name): p.dtype for name, p in model.named_parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}


def test_the_frozen_base_is_bfloat16_only_where_the_learner_computes_in_it():
    gpu, cpu = World(0, 1, torch.device("cuda")), World(0, 1, torch.device("cpu"))
    assert frozen_base_dtype("float32", LearnerConfig(mixed_precision=True), gpu) == "bfloat16"
    assert frozen_base_dtype("float32", LearnerConfig(mixed_precision=False), gpu) == "float32"
    assert frozen_base_dtype("float32", LearnerConfig(mixed_precision=True), cpu) == "float32"


def test_with_the_adapters_off_the_policy_scores_as_its_base_and_trains_again_after():
    model = adapted()
    move_adapters(model)
    base = scores(tiny_policy())
    assert not torch.allclose(scores(model), base)
    assert torch.equal(scores(AdaptersOff(model)), base)
    with adapters_disabled(model):
        assert not any(p.requires_grad for p in model.parameters())
    assert sum(p.requires_grad for p in model.parameters()) == 12
    assert not torch.allclose(scores(model), base)  # switched back on


def test_dropout_acts_in_training_passes_only():
    model = adapted(LoraConfig(enabled=True, rank=4, dropout=0.5, target_modules=["q_proj"]))
    move_adapters(model)
    torch.manual_seed(0)
    assert torch.equal(scores(model), scores(model))
    with adapter_dropout(model):
        assert not torch.equal(scores(model), scores(model))
    assert torch.equal(scores(model), scores(model))


def test_adapter_names_are_those_of_peft_files(tmp_path):
    model = adapted()
    move_adapters(model)
    reference = get_peft_model(tiny_policy(), peft_config(LORA))
    reference.save_pretrained(tmp_path)
    written = load_file(tmp_path / "adapter_model.safetensors")
    named = dict(adapter_tensors(model))
    assert sorted(named) == sorted(written)
    # loaded by PEFT under those names, the adapter scores as the learner's model does
    reference.base_model.model.load_state_dict(
        {name: tensor for name, tensor in model.state_dict().items() if is_adapter_weight(name)}, strict=False)
    reference.save_pretrained(tmp_path)
    assert all(torch.equal(named[name], tensor) for name, tensor in load_file(tmp_path / "adapter_model.safetensors").items())


@pytest.mark.parametrize("lora, key, words", [
    (LoraConfig(enabled=True, target_modules=["q_proj", "qkv"]), "model.lora.target_modules", "['qkv']"),
    (LoraConfig(enabled=True, target_modules=["lm_head"]), "model.lora.target_modules", "['lm_head']"),
    (LoraConfig(enabled=True, rank=17, target_modules=["q_proj", "k_proj"]), "model.lora.rank",
     "17 exceeds 16, the smaller side of the 'k_proj' layers (32 -> 16)"),
])
def test_a_lora_that_does_not_fit_the_model_is_refused_naming_the_key(lora, key, words):
    with pytest.raises(ConfigError) as refused:
        adapted(lora)
    assert str(refused.value).startswith(f"{key}: ") and words in str(refused.value)


def test_the_rank_may_equal_the_smaller_side():
    assert len(lora_layers(adapted(LoraConfig(enabled=True, rank=16, target_modules=["k_proj"])))) == 2


@pytest.mark.parametrize("override, key", [
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
    ("model.lora.rank=0", "model.lora.rank"),
    ("model.lora.rank=513", "model.lora.rank"),
    ("model.lora.dropout=1.0", "model.lora.dropout"),
])
def test_config_refuses_a_lora_section_it_cannot_serve(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(overrides=["model.lora.enabled=true", override])
