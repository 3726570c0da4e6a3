"""init-model on Qwen3's real tokenizer (model.tiny.tokenizer=qwen3): a Hugging Face directory that loads as any
Qwen model does (151,669-token BPE, Qwen3's special tokens, its chat template with tools and thinking), warm-started
in that tokenizer's ids."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import load_config
from asyncrl.config.sections import TaskConfig, WarmStartConfig
from demo.tasks import arithmetic
from demo.tiny.build import init_model
from demo.tiny.model import build_tiny_model
from demo.tiny.pinned_tokenizer import QWEN3
from demo.tiny.vocabulary import build_tokenizer, load_pinned
from demo.tiny.warm_start import pad_examples, supervised_example, warm_start
from rollout_servers.rewards.builtin import scorer_for

QWEN3_VOCAB = 151_669
IM_END, END_OF_TEXT = 151_645, 151_643  # Qwen3's ids of <|im_end|> and <|endoftext|>
SMALL = ["model.tiny.tokenizer=qwen3", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
         "model.tiny.intermediate_size=64", "model.warm_start.steps=2", "model.warm_start.batch_size=4",
         "model.warm_start.eval_samples=4"]


@pytest.fixture(scope="module")
def qwen3():
    return build_tokenizer("qwen3")


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


def test_the_warm_start_teaches_arithmetic_in_the_real_tokenizers_ids(qwen3):
    config = load_config(None, ["model.tiny.tokenizer=qwen3", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
                                "model.tiny.intermediate_size=128"])
    model = build_tiny_model(config.model.tiny, qwen3, seed=0)
    rng = random.Random(99)
    held_out = [supervised_example(qwen3, *arithmetic.make_problem(rng, 1, 1, "+")) for _ in range(32)]
    assert all(ids[-1] == IM_END and max(ids) < QWEN3_VOCAB for ids, _ in held_out)
    input_ids, labels, attention = pad_examples(held_out, qwen3.pad_token_id)

    def loss() -> float:
        with torch.no_grad():
            return model(input_ids=input_ids, attention_mask=attention, labels=labels).loss.item()

    before = loss()
    schedule = WarmStartConfig(steps=30, batch_size=16, lr=3e-3, warmup_steps=5)
    warm_start(model, qwen3, TaskConfig(max_digits=1, operators="+"), schedule, seed=0, held_out=frozenset())
    assert loss() < 0.6 * before  # random init ≈ ln(151,669) ≈ 11.9 nats; 30 steps reach 6.2 (seed 0)


def test_a_missing_cache_names_the_setup_step(monkeypatch, tmp_path):
    import demo.tiny.pinned_tokenizer as pinned

    monkeypatch.setattr(pinned, "CACHE_ROOT", tmp_path)
    with pytest.raises(FileNotFoundError, match="scripts/setup_env.sh"):
        load_pinned(QWEN3)
