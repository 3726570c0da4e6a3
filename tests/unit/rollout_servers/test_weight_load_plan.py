"""The weight load plan on a small model built like a vLLM model: where each checkpoint tensor lands (exact rows),
what goes to vLLM's `load_weights` instead, and the check that keeps a wrong plan from writing anywhere."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from asyncrl.weight_transfer import parse_update_info, update_info_for
from rollout_servers.weight_load_plan import NO_PARAMETER, Layout, LoadPaths, checked_plan, layout_of, resolve
from tests.unit.rollout_servers.fake_layers import KINDS, PADDED_VOCAB, VOCAB, FakeModel, checkpoint

FALLBACK = {"layers.0.extra.weight"}  # a loader of its own (the tied head is skipped, as vLLM's loader skips it)


class RecordingLoader:
    """The model's `load_weights`, recording the names of each call."""

    def __init__(self, model: FakeModel) -> None:
        self.model, self.calls = model, []

    def __call__(self, weights) -> None:
        named = list(weights)
        self.calls.append([name for name, _ in named])
        self.model.load_weights(named)


def layout(named: list[tuple[str, torch.Tensor]]) -> Layout:
    """The layout of a round of `named`, as the plugin reads it off the update's announcement."""
    return layout_of(parse_update_info(update_info_for(named)))


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def assert_same_weights(model: nn.Module, reference: nn.Module) -> None:
    got, expected = params(model), params(reference)
    assert got.keys() == expected.keys()
    mismatched = [name for name in got if not torch.equal(got[name], expected[name])]
    assert not mismatched, f"parameters that differ from what load_weights alone leaves: {mismatched}"


def fallback_names(plan) -> dict[str, str]:
    return {plan.layout[index][0]: reason for index, reason in plan.fallback.items()}


def test_each_tensor_lands_in_the_rows_its_packed_or_padded_parameter_holds_it_in():
    model, named = FakeModel(), checkpoint(seed=1)
    sent = dict(named)
    loader = RecordingLoader(model)
    plan = resolve(model, layout(named), KINDS)
    model.embed.weight.data[VOCAB:] = 7.0  # the padding rows, as they were before the round

    assert plan.load(named, loader) == LoadPaths(batched=len(named) - 2, load_weights=1, tied=1)

    attn, mlp, prefix = model.layers[0].attn, model.layers[0].mlp, "layers.0."
    expected_rows = [  # (parameter, start, stop, the checkpoint tensor it holds there)
        (attn.qkv_proj.weight, 0, 4, "attn.q_proj.weight"), (attn.qkv_proj.weight, 4, 6, "attn.k_proj.weight"),
        (attn.qkv_proj.weight, 6, 8, "attn.v_proj.weight"), (attn.qkv_proj.bias, 0, 4, "attn.q_proj.bias"),
        (attn.qkv_proj.bias, 4, 6, "attn.k_proj.bias"), (attn.qkv_proj.bias, 6, 8, "attn.v_proj.bias"),
        (mlp.gate_up_proj.weight, 0, 6, "mlp.gate_proj.weight"), (mlp.gate_up_proj.weight, 6, 12, "mlp.up_proj.weight"),
        (attn.o_proj.weight, 0, 4, "attn.o_proj.weight"), (mlp.down_proj.weight, 0, 4, "mlp.down_proj.weight"),
        (model.layers[0].norm.weight, 0, 4, "norm.weight"),
    ]
    for param, start, stop, name in expected_rows:
        assert torch.equal(param.data[start:stop], sent[prefix + name]), name
    assert torch.equal(model.embed.weight.data[:VOCAB], sent["embed.weight"])
    assert torch.equal(model.embed.weight.data[VOCAB:], torch.full((PADDED_VOCAB - VOCAB, 4), 7.0)), \
        "the padding rows are left alone"
    assert loader.calls == [["layers.0.extra.weight"]], "one load_weights call, the rest only"
    assert torch.equal(model.layers[0].extra.weight.data, sent["layers.0.extra.weight"] * 2)


def test_what_the_plan_cannot_resolve_safely_goes_to_load_weights_with_its_reason():
    model = FakeModel()
    named = dict(checkpoint(seed=1))
    named["layers.0.attn.o_proj.weight"] = named["layers.0.attn.o_proj.weight"].double()  # not the served dtype
    named["layers.0.mlp.down_proj.weight"] = named["layers.0.mlp.down_proj.weight"].t()  # a shape that does not fit
    named["layers.0.attn.q_proj.weight"] = torch.zeros(3, 4)  # rows that are not the shard's
    named["layers.0.unknown.weight"] = torch.zeros(2)
    plan = resolve(model, layout(list(named.items())), KINDS)

    reasons = fallback_names(plan)
    assert set(reasons) == FALLBACK | {"layers.0.attn.o_proj.weight", "layers.0.mlp.down_proj.weight",
                                       "layers.0.attn.q_proj.weight", "layers.0.unknown.weight"}
    assert reasons["layers.0.unknown.weight"] == NO_PARAMETER
    assert reasons["layers.0.extra.weight"] == "OwnLoader loads layers.0.extra.weight with a loader of its own"
    assert reasons["layers.0.attn.o_proj.weight"] == "sent as torch.float64, served as torch.float32"
    assert reasons["layers.0.mlp.down_proj.weight"] == \
        "shape [6, 4] does not fit layers.0.mlp.down_proj.weight [4, 6] as a plain tensor"
    assert reasons["layers.0.attn.q_proj.weight"].startswith("shape [3, 4] does not fit layers.0.attn.qkv_proj.weight")
    assert len(plan.planned) == len(named) - len(reasons) - len(plan.tied)


def test_a_tied_alias_is_skipped_unless_its_parameter_loads_through_load_weights_then_it_goes_along():
    model, named = FakeModel(), checkpoint(seed=1)
    plan = resolve(model, layout(named), KINDS)
    assert {plan.layout[alias][0]: plan.layout[index][0] for alias, index in plan.tied.items()} == \
        {"lm_head.weight": "embed.weight"}

    named[0] = ("embed.weight", named[0][1].double())  # the embedding now goes to load_weights
    loader = RecordingLoader(model)
    plan = resolve(model, layout(named), KINDS)
    assert plan.tied == {}
    assert fallback_names(plan)["lm_head.weight"] == "tied to embed.weight, which loads through load_weights"
    plan.load(named, loader)
    assert loader.calls == [["embed.weight", "layers.0.extra.weight", "lm_head.weight"]], "one call, in announced order"


def test_tensors_whose_rows_overlap_are_all_left_to_load_weights():
    model = FakeModel()
    named = checkpoint(seed=1) + [("layers.0.attn.qkv_proj.weight", torch.zeros(8, 4))]  # fused and shards both sent
    reasons = fallback_names(resolve(model, layout(named), KINDS))
    overlapping = {"layers.0.attn.qkv_proj.weight", "layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight",
                   "layers.0.attn.v_proj.weight"}
    assert set(reasons) == FALLBACK | overlapping
    assert all("overlap" in reasons[name] for name in overlapping)


def test_a_checked_plan_that_agrees_with_the_loader_loads_later_rounds_as_the_loader_alone_would():
    model, reference = FakeModel(), FakeModel()
    loader = RecordingLoader(model)
    first = checkpoint(seed=1)
    plan = checked_plan(model, first, layout(first), loader, KINDS)
    reference.load_weights(first)
    assert plan.paths(checked=True) == LoadPaths(batched=len(first) - 2, load_weights=1, tied=1, checked_plan=True)
    assert_same_weights(model, reference)

    for seed in (2, 3):
        loader.calls.clear()
        named = checkpoint(seed)
        assert plan.fits(model, layout(named))
        plan.load(named, loader)
        reference.load_weights(named)
        assert_same_weights(model, reference)
        assert loader.calls == [sorted(FALLBACK)]


def test_a_plan_the_loader_disagrees_with_is_caught_even_where_the_values_repeat(caplog):
    """The model's q/k/v loader really stacks q, v, k; the plan (from `output_sizes`) puts k before v. The first round
    sends a fresh model's zero biases, which would match in either place: the check still catches k and v."""
    model, reference = FakeModel(qkv_stacking=[0, 2, 1]), FakeModel(qkv_stacking=[0, 2, 1])
    first = checkpoint(seed=1, fresh_biases=True)
    with caplog.at_level(logging.INFO, logger="rollout_servers.weight_load_plan"):
        plan = checked_plan(model, first, layout(first), RecordingLoader(model), KINDS)
    reference.load_weights(first)
    assert_same_weights(model, reference)

    swapped = {f"layers.0.attn.{shard}_proj.{leaf}" for shard in "kv" for leaf in ("weight", "bias")}
    assert set(fallback_names(plan)) == FALLBACK | swapped
    assert all(f"'{name}' elsewhere" in caplog.text for name in swapped)
    assert (f"{len(first) - 6} of {len(first)} tensors load in one batched copy, 5 through load_weights, "
            "1 skipped as tied aliases") in caplog.text

    second = checkpoint(seed=2)
    plan.load(second, model.load_weights)
    reference.load_weights(second)
    assert_same_weights(model, reference)


def test_a_loader_that_writes_beyond_the_plan_drops_the_plan(caplog):
    """Each view holds its tensor, but the loader also copies the norm somewhere no view points: left to the plan,
    that copy would go stale. Every tensor loads through load_weights."""
    model, reference = FakeModel(), FakeModel()
    for fake in (model, reference):
        fake.norm_copy = nn.Parameter(torch.zeros(4))
        fake.load_weights = _also_copying_the_norm(fake)
    first = checkpoint(seed=1)
    with caplog.at_level(logging.WARNING, logger="rollout_servers.weight_load_plan"):
        plan = checked_plan(model, first, layout(first), model.load_weights, KINDS)
    reference.load_weights(first)

    assert plan.paths() == LoadPaths(batched=0, load_weights=len(first))
    assert "also writes ['norm_copy']" in caplog.text
    assert_same_weights(model, reference)


def _also_copying_the_norm(model: FakeModel):
    own_loader = model.load_weights

    def load_weights(weights) -> None:
        named = list(weights)
        own_loader(named)
        for name, tensor in named:
            if name == "layers.0.norm.weight":
                model.norm_copy.data.copy_(tensor)

    return load_weights


def test_a_plan_fits_only_its_model_its_layout_and_the_parameters_it_points_into():
    model, named = FakeModel(), checkpoint(seed=1)
    plan = resolve(model, layout(named), KINDS)
    assert plan.fits(model, layout(named))
    assert not plan.fits(FakeModel(), layout(named))
    assert not plan.fits(model, layout(named[:-1]))
    model.layers[0].attn.o_proj.weight.data = torch.zeros(4, 4)  # reallocated: the view points into the old memory
    assert not plan.fits(model, layout(named))
    replaced = FakeModel()
    plan = resolve(replaced, layout(named), KINDS)
    replaced.layers[0].norm.weight = nn.Parameter(torch.ones(4))
    assert not plan.fits(replaced, layout(named))


@pytest.mark.parametrize("stops_after", [0, 1])
def test_a_loader_that_stops_early_fails_naming_the_first_tensor_it_left(stops_after):
    model, named = FakeModel(), checkpoint(seed=1) + [("layers.0.unknown.weight", torch.zeros(2))]
    plan = resolve(model, layout(named), KINDS)

    def stops(weights) -> None:
        for _ in range(stops_after):
            next(weights)

    first_left = ["layers.0.extra.weight", "layers.0.unknown.weight"][stops_after]
    with pytest.raises(RuntimeError, match=f"stopped before {2 - stops_after} announced tensors, first '{first_left}'"):
        plan.load(named, stops)
