"""The warm-start benchmark (scripts/bench_warm_start.py): its variants' parsing, and that the tokens it counts are
the ones its timed steps trained."""

import pytest

import demo.tiny.warm_start as warm_start_module
from scripts.bench_warm_start import parse_variant, time_variant

TINY = ["model.warm_start.device=cpu", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
        "model.tiny.intermediate_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.warm_start.batch_size=4"]


def test_a_variant_is_a_name_then_its_overrides():
    assert parse_variant("det-mb4=model.warm_start.deterministic=true model.warm_start.micro_batches=4") == (
        "det-mb4", ["model.warm_start.deterministic=true", "model.warm_start.micro_batches=4"])
    for malformed in ("no-overrides", "=a=b", "name=  "):
        with pytest.raises(SystemExit, match="expected NAME=KEY=VALUE"):
            parse_variant(malformed)


def test_the_tokens_counted_are_those_of_the_timed_steps(monkeypatch):
    trained = []  # tokens per call of the supervised step, untimed steps first
    real_step = warm_start_module.accumulate_gradient

    def counting_step(model, batch, pad_id, micro_batches):
        trained.append(sum(len(ids) for ids, _ in batch))
        return real_step(model, batch, pad_id, micro_batches)

    monkeypatch.setattr(warm_start_module, "accumulate_gradient", counting_step)
    figures = time_variant("configs/gpu_longtail.yaml", TINY, warmup_steps=2, steps=3)
    assert len(trained) == 5
    assert figures["tokens"] == sum(trained[2:])
    assert figures["tokens_per_s"] == pytest.approx(figures["tokens"] / (3 * figures["step_s"]), rel=1e-2)
    assert figures["device"] == "cpu" and figures["parameters"] > 0
