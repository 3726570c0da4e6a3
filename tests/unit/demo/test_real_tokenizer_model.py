"""init-model on Qwen3's real tokenizer (model.tiny.tokenizer=qwen3): a Hugging Face directory that loads as any
Qwen model does (151,669-token BPE, Qwen3's special tokens, its chat template with tools and thinking). The warm
start in its ids: test_tiny_model.py."""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import load_config
from demo.tiny.build import init_model
from demo.tiny.pinned_tokenizer import QWEN3
from demo.tiny.vocabulary import load_pinned
from rollout_servers.rewards.builtin import scorer_for

QWEN3_VOCAB = 151_669
IM_END, END_OF_TEXT = 151_645, 151_643  # Qwen3's ids of <|im_end|> and <|endoftext|>
SMALL = ["model.tiny.tokenizer=qwen3", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
         "model.tiny.intermediate_size=64", "model.warm_start.steps=2", "model.warm_start.batch_size=4",
         "model.warm_start.eval_samples=4"]


def test_init_model_saves_a_qwen_directory_with_the_real_vocabulary_and_template(tmp_path):
    config = load_config(None, [*SMALL, f"model.path={tmp_path / 'm'}"])
    report = init_model(config, scorer_for)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert type(tokenizer).__name__.startswith("Qwen2Tokenizer") and len(tokenizer) == QWEN3_VOCAB
    assert model.config.vocab_size == QWEN3_VOCAB == model.get_output_embeddings().weight.shape[0]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id) == (IM_END, END_OF_TEXT, END_OF_TEXT)
    assert model.generation_config.eos_token_id == [IM_END, END_OF_TEXT]
    pinned = json.loads((QWEN3.cache_dir() / "tokenizer_config.json").read_text())["chat_template"]
    assert tokenizer.chat_template == pinned
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tools=tools, add_generation_prompt=True,
                                             enable_thinking=False, tokenize=False)
    assert "<tools>" in rendered and rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert report["parameters"] == sum(p.numel() for p in model.parameters())


def test_a_missing_cache_names_the_setup_step(monkeypatch, tmp_path):
    import demo.tiny.pinned_tokenizer as pinned

    monkeypatch.setattr(pinned, "CACHE_ROOT", tmp_path)
    with pytest.raises(FileNotFoundError, match="scripts/setup_env.sh"):
        load_pinned(QWEN3)
