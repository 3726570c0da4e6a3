"""scripts/bench_learner.py's FLOP count of one step, by hand: per pass 2 FLOPs per matmul parameter per token plus
2 · layers · width · length² of attention per sample; forward and backward are 3 passes, a proximal pass (losses
that anchor on the pre-update policy) and a reference pass one more each."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from scripts.bench_learner import Shape, step_flops

# hidden 8, 2 heads of 4 (one key/value head), MLP 16, one layer, vocabulary 10. The parameters counted (every
# one, less an untied input embedding): q 8·8+8, k and v 8·4+4 each, o 8·8, gate, up and down 8·16 each, the head
# 10·8, three norms 8 each: 696.
MATMUL_PARAMETERS = 64 + 8 + 2 * (32 + 4) + 64 + 3 * 128 + 80 + 3 * 8
LENGTHS = (3, 5)  # tokens per sample: 8 in all; squared 9 + 25 = 34
FORWARD = 2 * MATMUL_PARAMETERS * 8 + 2 * 1 * 8 * 34  # one pass: 11,680


def model(tied: bool) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("tied", [True, False])  # untied: the head counts, the input embedding (a lookup) does not
@pytest.mark.parametrize(("loss", "reference", "passes"), [
    ("naive_ppo", False, 3), ("decoupled_ppo", False, 4), ("decoupled_ppo", True, 5),
])
def test_step_flops_by_hand(tied, loss, reference, passes):
    shape = Shape(hidden=8, layers=1, heads=2, kv_heads=1, intermediate=16, vocab=10, tied=tied)
    mask = torch.tensor([[1] * n + [0] * (max(LENGTHS) - n) for n in LENGTHS])  # [B, T]
    batch = SimpleNamespace(attention_mask=mask)  # all the count reads of a TrainBatch
    assert step_flops(model(tied), shape, batch, loss, reference) == passes * FORWARD
