"""Builds the tiny Qwen2-architecture causal LM from config, randomly initialised, on the CPU."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from asyncrl.config.sections import TinyModelConfig

_INIT_STD = 0.02  # initializer range, as in the Qwen2 release configs
_ROPE_THETA = 10000.0  # rotary base; sequences here are short
# Qwen's document separator: the model's bos and, beside the chat end-of-turn token, a second stop token (as
# Qwen3's generation config lists it); the character tokenizer has it too.
DOCUMENT_END = "<|endoftext|>"


def build_tiny_model(shape: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2ForCausalLM of the given shape (deterministic for `seed`)."""
    config = Qwen2Config(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position,
        tie_word_embeddings=shape.tie_word_embeddings,
        vocab_size=max(shape.vocab_size, len(tokenizer)),  # every token the tokenizer has gets an embedding row
        bos_token_id=tokenizer.convert_tokens_to_ids(DOCUMENT_END),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=_INIT_STD,
        rope_theta=_ROPE_THETA,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(DOCUMENT_END)]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
