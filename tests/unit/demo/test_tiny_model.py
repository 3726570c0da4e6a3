"""init-model: a standard HF directory, deterministic for a seed, cached, and warm-starting helps."""

import json
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import load_config
from demo.tasks import arithmetic
from asyncrl.thinking import Thinking
from demo.tiny.build import at_most_threads, cache_key, deterministic_kernels, init_model, weights_digest
from demo.tiny.report import REPORT_FILE
from demo.tiny.model import build_tiny_model
from demo.tiny.vocabulary import build_tokenizer
from asyncrl.config.sections import TaskConfig, WarmStartConfig
from demo.tiny.warm_start import accumulate_gradient, pad_examples, supervised_example, warm_start
from rollout_servers.rewards.builtin import scorer_for

SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
         "model.warm_start.steps=3", "model.warm_start.batch_size=4", "model.warm_start.eval_samples=4"]


def test_init_model_writes_loadable_hf_directory_and_caches(tmp_path):
    config = load_config(None, [*SMALL, f"model.path={tmp_path / 'm'}"])
    report = init_model(config, scorer_for)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer) and model.config.eos_token_id == tokenizer.eos_token_id
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    assert 0.0 <= report["accuracy_after_warm_start"] <= 1.0
    assert json.loads((tmp_path / "m" / REPORT_FILE).read_text()) == report
    weights = tmp_path / "m" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert init_model(config, scorer_for) == report and weights.stat().st_mtime_ns == stamp  # cached: nothing rewritten
    changed = load_config(None, [*SMALL, f"model.path={tmp_path / 'm'}", "model.warm_start.steps=4"])
    assert init_model(changed, scorer_for)["warm_start_steps"] == 4 and weights.stat().st_mtime_ns != stamp


def test_only_thinking_off_changes_the_cache_key():
    """`off` changes the warm start's prompts on templates that think; `trained` and `masked` render them as before, so
    models built before `rollout.thinking` existed keep their keys."""
    qwen3 = build_tokenizer("qwen3")
    keys = {mode: cache_key(load_config(None, [*SMALL, f"rollout.thinking={mode}"]), qwen3,
                            Thinking.for_tokenizer(mode, qwen3)) for mode in ("trained", "masked", "off")}
    assert keys["trained"] == keys["masked"] != keys["off"]


def test_same_seed_same_weights(tmp_path):
    states = []
    for name in ("a", "b"):
        config = load_config(None, [*SMALL, f"model.path={tmp_path / name}", "run.seed=4"])
        init_model(config, scorer_for)
        states.append(AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    reports = [json.loads((tmp_path / name / REPORT_FILE).read_text()) for name in ("a", "b")]
    assert reports[0]["weights_sha256"] == reports[1]["weights_sha256"]


def test_the_digest_changes_with_any_weight_and_only_with_the_weights():
    config = load_config(None, SMALL)
    model = build_tiny_model(config.model.tiny, build_tokenizer(config.model.tiny.tokenizer), 0)
    before = weights_digest(model)
    assert weights_digest(build_tiny_model(config.model.tiny, build_tokenizer(config.model.tiny.tokenizer), 0)) == before
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[0] += 1e-3
    assert weights_digest(model) != before
    assert weights_digest(model.to(torch.bfloat16)) != weights_digest(model.float())  # the dtype is part of it


def right_padding_mask(examples: list) -> torch.Tensor:
    """The attention mask of `pad_examples`' batch: 1 on each example's own tokens, 0 on its padding."""
    width = max(len(ids) for ids, _ in examples)
    return torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in examples])


@pytest.mark.parametrize("vocabulary", ["char", "qwen3"])
def test_warm_start_lowers_the_answer_loss(vocabulary):
    config = load_config(None, ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
                                f"model.tiny.tokenizer={vocabulary}"])
    tokenizer = build_tokenizer(vocabulary)
    model = build_tiny_model(config.model.tiny, tokenizer, seed=0)
    rng = random.Random(99)
    held_out = [supervised_example(tokenizer, *arithmetic.make_problem(rng, 1, 1, "+")) for _ in range(32)]
    assert all(ids[-1] == tokenizer.eos_token_id and max(ids) < len(tokenizer) for ids, _ in held_out)  # its own ids
    input_ids, labels = pad_examples(held_out, tokenizer.pad_token_id)
    attention = right_padding_mask(held_out)

    def loss() -> float:
        with torch.no_grad():
            return model(input_ids=input_ids, attention_mask=attention, labels=labels).loss.item()

    before = loss()
    schedule = WarmStartConfig(steps=12, batch_size=8, lr=2e-2, warmup_steps=5)  # a step over Qwen3's 151,669 ids: ~0.4 s
    warm_start(model, tokenizer, TaskConfig(max_digits=1, operators="+"), schedule, seed=0, held_out=frozenset())
    assert loss() < 0.6 * before  # random init ≈ ln(vocabulary): 4.6 (char), 11.9 nats (qwen3); 12 steps learn the format at least


def test_the_warm_starts_thread_cap_lowers_and_then_restores_torchs_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        with at_most_threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 3
        with at_most_threads(8):  # fewer cores than the cap: as many as there are
            assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_passes_over_the_batch_sorted_by_length_give_the_one_pass_loss_and_gradient():
    """A step in 3 passes (examples sorted by length, each pass padded to its own longest) takes the gradient of the
    batch's mean token loss, as one pass over the whole padded batch does; 5 passes for 4 examples: one each."""
    config = load_config(None, ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64"])
    tokenizer = build_tokenizer("char")
    rng = random.Random(5)
    problems = [arithmetic.make_problem(rng, 1, digits, "+") for digits in (1, 6, 2, 9, 3, 1, 12)]
    batch = [supervised_example(tokenizer, question, answer * (1 + index % 3)) for index, (question, answer)
             in enumerate(problems)]  # learned lengths 2 to 40 tokens: much padding in one pass

    def one_pass(examples: list) -> tuple[float, list[torch.Tensor]]:
        model = build_tiny_model(config.model.tiny, tokenizer, seed=0)
        input_ids, labels = pad_examples(examples, tokenizer.pad_token_id)
        attention = right_padding_mask(examples)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss  # HF's mean over the batch
        loss.backward()
        return loss.item(), [parameter.grad for parameter in model.parameters()]

    def in_passes(micro_batches: int, examples: list) -> tuple[float, list[torch.Tensor]]:
        model = build_tiny_model(config.model.tiny, tokenizer, seed=0)
        loss = accumulate_gradient(model, examples, tokenizer.pad_token_id, micro_batches)
        return loss.item(), [parameter.grad for parameter in model.parameters()]

    for micro_batches, examples in ((1, batch), (3, batch), (5, batch[:4])):
        (want_loss, want_grads), (loss, grads) = one_pass(examples), in_passes(micro_batches, examples)
        assert loss == pytest.approx(want_loss, rel=1e-5)
        for got, want in zip(grads, want_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_no_greedy_pass_without_held_out_problems_to_decode(tmp_path, monkeypatch):
    import demo.tiny.build as build

    def refuse(*_args, **_kwargs):
        raise AssertionError("a greedy pass ran with eval_samples=0")

    monkeypatch.setattr(build, "greedy_accuracy", refuse)
    config = load_config(None, [*SMALL, f"model.path={tmp_path / 'm'}", "model.warm_start.eval_samples=0"])
    report = init_model(config, scorer_for)
    assert report["accuracy_before_warm_start"] is None and report["accuracy_after_warm_start"] is None
    assert report["weights_sha256"] and (tmp_path / "m" / "model.safetensors").is_file()


def test_deterministic_kernels_are_asked_for_only_when_enabled_and_the_settings_come_back(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with deterministic_kernels(True):  # torch's flags alone: no CUDA call is made
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cuda.flash_sdp_enabled()  # strict mode makes its backward deterministic
    assert not torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_kernels(True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # the process's own setting stands


def test_the_deterministic_setting_leaves_the_cache_key_as_it_was():
    tokenizer = build_tokenizer("char")
    thinking = Thinking.for_tokenizer("trained", tokenizer)
    keys = {flag: cache_key(load_config(None, [*SMALL, f"model.warm_start.deterministic={flag}"]), tokenizer, thinking)
            for flag in ("false", "true")}
    assert keys["false"] == keys["true"]


def test_only_the_warm_start_runs_under_deterministic_kernels_not_the_greedy_passes(tmp_path, monkeypatch):
    import contextlib

    import demo.tiny.build as build

    seen, inside = [], []

    @contextlib.contextmanager
    def recording(enabled):
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(build, "deterministic_kernels", recording)
    monkeypatch.setattr(build, "greedy_accuracy", lambda *args, **kwargs: seen.append(("greedy", bool(inside))) or 0.5)
    monkeypatch.setattr(build, "warm_start", lambda *args, **kwargs: seen.append(("warm start", bool(inside))))
    init_model(load_config(None, [*SMALL, f"model.path={tmp_path / 'm'}", "model.warm_start.eval_samples=2"]), scorer_for)
    assert seen == [("greedy", False), ("warm start", True), ("greedy", False)]
