"""A packed optimizer step trains exactly like a padded one (same loss, metrics and update, float64), whatever
the activation checkpointing; and what each checkpointing mode keeps for backward shrinks as promised."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.messages import Trajectory, TrajectoryGroup
from learner.distributed import World
from learner.maths.batching import collate
from learner.maths.logprobs import target_logprobs
from learner.policy.activation_checkpointing import AUTO, FULL, MODES, NONE, SELECTIVE, apply_activation_checkpointing
from learner.policy.train_step import Passes, train_step
from policy_helpers import tiny_policy

CPU_WORLD = World(rank=0, size=1, device=torch.device("cpu"))


def groups() -> list[TrajectoryGroup]:
    rng = random.Random(0)
    result = []
    for g in range(3):
        samples = []
        for _ in range(3):
            n = rng.randint(1, 12)
            samples.append(Trajectory([rng.randrange(1, 50) for _ in range(rng.randint(2, 6))],
                                      [rng.randrange(1, 50) for _ in range(n)], [rng.uniform(-4, -0.5) for _ in range(n)],
                                      [0] * n, [rng.choice([1, 1, 0]) for _ in range(n)], rng.random(), f"g{g}", "a", "stop"))
        result.append(TrajectoryGroup(f"r{g}", f"g{g}", "s", samples))
    return result


def one_step(packed: bool, checkpointing: str = NONE, loss: str = "decoupled_ppo", budget: int = 40):
    model = tiny_policy()
    apply_activation_checkpointing(list(model.model.layers), checkpointing)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    passes = Passes(budget, packed=packed, temperature=0.9)
    outcome = train_step(model, optimizer, collate(groups(), 0), AlgorithmConfig(loss=loss), passes, 0.0, CPU_WORLD)
    return outcome.metrics, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("loss", ["decoupled_ppo", "tis", "seq_mask"])
def test_packed_and_padded_steps_give_the_same_loss_and_update(loss):
    # 40 tokens per pass: packed and padded cut the batch into different micro-batches, and the whole-batch
    # loss and gradient must not depend on that
    padded_metrics, padded_weights = one_step(packed=False, loss=loss)
    packed_metrics, packed_weights = one_step(packed=True, loss=loss)
    assert padded_metrics["actor/pg_loss"] != 0.0
    assert packed_metrics["actor/pg_loss"] == pytest.approx(padded_metrics["actor/pg_loss"], rel=1e-9)
    initial = dict(tiny_policy().named_parameters())
    for name, weight in padded_weights.items():
        assert not torch.equal(weight, initial[name].detach()), name  # every weight moved
        assert torch.allclose(packed_weights[name], weight, rtol=0, atol=1e-12), name


def test_with_one_micro_batch_every_metric_is_the_same():
    # metrics other than the loss are means over micro-batches, so they agree when the micro-batches do
    padded, _ = one_step(packed=False, budget=10_000)
    packed, _ = one_step(packed=True, budget=10_000)
    assert packed.keys() == padded.keys()
    for key, value in padded.items():
        assert packed[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("checkpointing", [SELECTIVE, FULL])
def test_checkpointing_changes_no_number(checkpointing):
    _, plain = one_step(packed=True)
    _, recomputed = one_step(packed=True, checkpointing=checkpointing)
    for name, weight in plain.items():
        assert torch.allclose(recomputed[name], weight, rtol=0, atol=1e-12), name


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(checkpointing: str, switched: bool = False) -> Counter:
    """aten ops run during backward of one packed forward (recomputed forward ops included); `switched`: the
    layers wrapped for auto, with the switch set to `checkpointing`."""
    model = tiny_policy(layers=3)
    if switched:
        apply_activation_checkpointing(list(model.model.layers), AUTO).mode = checkpointing
    else:
        apply_activation_checkpointing(list(model.model.layers), checkpointing)
    input_ids = torch.randint(1, 50, (4, 30), generator=torch.Generator().manual_seed(0))
    chosen, _ = target_logprobs(model, input_ids, torch.ones_like(input_ids), packed=True)
    with OpCounter() as counter:
        chosen.sum().backward()
    return counter.counts


def test_selective_recomputes_elementwise_work_and_full_recomputes_the_products_too():
    ops = {mode: backward_ops(mode) for mode in MODES}
    products = {mode: ops[mode]["mm"] + ops[mode]["addmm"] for mode in MODES}
    assert products[NONE] == products[SELECTIVE] < products[FULL]  # products are kept by selective
    assert ops[NONE]["silu"] == 0 < ops[SELECTIVE]["silu"] == ops[FULL]["silu"]  # the MLP's activation is recomputed
    assert ops[NONE]["rsqrt"] == 0 < ops[SELECTIVE]["rsqrt"]  # and the RMS norms


def test_auto_layers_recompute_as_the_mode_their_switch_names():
    # auto wraps each layer once and reads the mode at every call: each mode must run as its fixed wrapping does
    for mode in MODES:
        assert backward_ops(mode, switched=True) == backward_ops(mode), mode

