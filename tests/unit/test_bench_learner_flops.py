"""scripts/bench_learner.py's FLOP count of one step, by hand: per pass 2 FLOPs per matmul parameter per token plus
2 · layers · width · length² of attention per sample; forward and backward are 3 passes, a proximal pass up front
(m2po: the other losses that anchor on the pre-update policy take it from the training pass at one optimizer step
per batch) and a reference pass one more each. With LoRA the frozen base's weight
gradients (2 FLOPs per matmul parameter per token) are not computed, and the adapters are not counted."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.config.sections import LoraConfig
from learner.policy.lora import add_adapters
from scripts.bench_learner import Shape, step_flops

# hidden 8, 2 heads of 4 (one key/value head), MLP 16, one layer, vocabulary 10. The parameters counted (every
# one, less an untied input embedding): q 8·8+8, k and v 8·4+4 each, o 8·8, gate, up and down 8·16 each, the head
# 10·8, three norms 8 each: 696.
MATMUL_PARAMETERS = 64 + 8 + 2 * (32 + 4) + 64 + 3 * 128 + 80 + 3 * 8
LENGTHS = (3, 5)  # tokens per sample: 8 in all; squared 9 + 25 = 34
WEIGHT_FLOPS = 2 * MATMUL_PARAMETERS * 8  # per pass: 11,136
FORWARD = WEIGHT_FLOPS + 2 * 1 * 8 * 34  # one pass: 11,680
MASK = torch.tensor([[1] * n + [0] * (max(LENGTHS) - n) for n in LENGTHS])  # [B, T]
BATCH = SimpleNamespace(attention_mask=MASK)  # all the count reads of a TrainBatch


def shape(tied: bool) -> Shape:
    return Shape(hidden=8, layers=1, heads=2, kv_heads=1, intermediate=16, vocab=10, tied=tied)


def model(tied: bool) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("tied", [True, False])  # untied: the head counts, the input embedding (a lookup) does not
@pytest.mark.parametrize(("loss", "reference", "passes"), [
    ("naive_ppo", False, 3), ("decoupled_ppo", False, 3), ("m2po", False, 4), ("m2po", True, 5),
])
def test_step_flops_by_hand(tied, loss, reference, passes):
    assert step_flops(model(tied), shape(tied), BATCH, loss, reference, lora=False) == passes * FORWARD


@pytest.mark.parametrize("tied", [True, False])
def test_lora_leaves_out_the_base_weight_gradients_and_the_adapters(tied):
    adapted = model(tied)
    add_adapters(adapted, list(adapted.model.layers), LoraConfig(enabled=True, rank=2), torch.float32)
    flops = step_flops(adapted, shape(tied), BATCH, "m2po", False, lora=True)
    assert flops == 4 * FORWARD - WEIGHT_FLOPS
