"""A tiny Qwen2 policy in float64, loaded with the learner's attention and scoring, for the learner's unit tests."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.maths import attention
from learner.maths.logprobs import attach_scoring


def tiny_policy(layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64) -> Qwen2ForCausalLM:
    """4 query heads sharing 2 key/value heads (grouped-query attention, as in Qwen2.5), tied head, vocabulary 50."""
    config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.set_attn_implementation(attention.register())
    return attach_scoring(model)
