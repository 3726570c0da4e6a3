"""Micro-batch sizing and the checkpointing mode from measured memory (hand-computed fits and choices), the CPU's
auto values, and an out-of-memory error that names the keys to change."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config.learner import LearnerConfig
from learner.distributed import World
from learner.policy.activation_checkpointing import AUTO, FULL, NONE, SELECTIVE, checkpointing_for_device
from learner.policy.memory import (
    CPU_MICRO_BATCH_TOKENS, MAX_AUTO_TOKENS, SHARED_GPU_USABLE_SHARE, USABLE_SHARE, LearnerOutOfMemory, PassMemory,
    choose_checkpointing, out_of_memory_names_keys, pass_memory, resolve_micro_batch_tokens, room_for_passes,
    tokens_that_fit,
)

MIB, GIB = 2**20, 2**30
CPU_WORLD = World(rank=0, size=1, device=torch.device("cpu"))


def test_the_budget_is_the_line_through_the_two_probes():
    # 10 GiB resident; 1 MiB per token; 2 GiB more whatever the size; 40 GiB free, 6 GiB of optimizer state ahead
    peaks = [10 * GIB + 2 * GIB + 2048 * MIB, 10 * GIB + 2 * GIB + 4096 * MIB]
    line = pass_memory((2048, 4096), peaks, resident=10 * GIB)
    assert line.per_token == pytest.approx(MIB)
    assert line.fixed == pytest.approx(2 * GIB)
    room = room_for_passes(40 * GIB, optimizer_state=6 * GIB)
    expected = int((40 * GIB * USABLE_SHARE - 6 * GIB - 2 * GIB) / MIB) // 1024 * 1024
    assert tokens_that_fit(line, room) == expected == 26624  # 26.0 GiB of room → 26,624 tokens, a multiple of 1,024
    shared = room_for_passes(40 * GIB, optimizer_state=6 * GIB, usable_share=SHARED_GPU_USABLE_SHARE)
    assert tokens_that_fit(line, shared) == int((40 * GIB * 0.7 - 8 * GIB) / MIB) // 1024 * 1024 == 20480  # keeps more back


def test_a_peak_that_does_not_grow_with_the_probe_takes_the_slope_of_what_the_forward_saved():
    # a large model: both probes peak at the end of the backward (12 GiB of gradients), while the forward kept
    # 2 MiB per token for the backward; the peaks' own line would see no cost per token at all
    peaks = [30 * GIB, 30 * GIB]
    saved = [2048 * 2 * MIB, 4096 * 2 * MIB]
    line = pass_memory((2048, 4096), peaks, resident=14 * GIB, saved=saved)
    assert line.per_token == pytest.approx(2 * MIB)
    assert line.fixed == pytest.approx(16 * GIB - 2048 * 2 * MIB)  # what the smaller probe needed beyond the line
    # (110 GiB · 0.85 - 20 - 12) / 2 MiB = 31,488, rounded down to a multiple of 1,024
    assert tokens_that_fit(line, room_for_passes(110 * GIB, optimizer_state=20 * GIB)) == 30720


def test_the_budget_is_capped_and_never_negative():
    roomy = pass_memory((2048, 4096), [GIB + 2048, GIB + 4096], resident=GIB)
    assert tokens_that_fit(roomy, room_for_passes(80 * GIB, optimizer_state=0)) == MAX_AUTO_TOKENS
    full = pass_memory((2048, 4096), [GIB, 2 * GIB], resident=0)
    assert tokens_that_fit(full, room_for_passes(GIB, optimizer_state=GIB)) == 0


# Pass memory of three modes: 4 GiB of gradients and gathered weights each; none keeps 1 MiB per token,
# selective 0.5 MiB, full 0.125 MiB. A pass of 16,384 tokens then needs 20, 12 and 6 GiB.
LINES = {NONE: PassMemory(per_token=MIB, fixed=4 * GIB), SELECTIVE: PassMemory(per_token=MIB / 2, fixed=4 * GIB),
         FULL: PassMemory(per_token=MIB / 8, fixed=4 * GIB)}


def choose(room: float, tokens: int = 16384) -> tuple[str, list[str]]:
    """The chosen mode and the modes measured to choose it (in order)."""
    measured = []

    def lines():
        for mode, line in LINES.items():
            measured.append(mode)
            yield mode, line

    return choose_checkpointing(lines(), room, tokens).mode, measured


def test_auto_checkpointing_keeps_every_activation_while_a_pass_fits():
    assert choose(room=20 * GIB) == (NONE, [NONE])  # exactly 20 GiB: fits, and nothing else is measured
    assert choose(room=60 * GIB) == (NONE, [NONE])


def test_auto_checkpointing_recomputes_elementwise_work_when_none_does_not_fit():
    assert choose(room=20 * GIB - 1) == (SELECTIVE, [NONE, SELECTIVE])  # one byte short for none
    assert choose(room=12 * GIB) == (SELECTIVE, [NONE, SELECTIVE])  # exactly selective's 12 GiB


def test_auto_checkpointing_recomputes_whole_layers_when_selective_does_not_fit():
    assert choose(room=12 * GIB - 1) == (FULL, [NONE, SELECTIVE, FULL])
    assert choose(room=6 * GIB) == (FULL, [NONE, SELECTIVE, FULL])
    # full is the least memory there is: chosen even where its pass does not fit (the micro-batch shrinks instead)
    choice = choose_checkpointing(iter(LINES.items()), 5 * GIB, 16384)
    assert choice.mode == FULL and choice.line == LINES[FULL]
    assert choice.needed == [(NONE, 20 * GIB), (SELECTIVE, 12 * GIB), (FULL, 6 * GIB)]


def test_auto_checkpointing_fits_a_configured_micro_batch():
    # 32,768 tokens: none needs 36 GiB, selective 20 GiB, full 8 GiB
    assert choose(room=36 * GIB, tokens=32768) == (NONE, [NONE])
    assert choose(room=30 * GIB, tokens=32768) == (SELECTIVE, [NONE, SELECTIVE])
    assert choose(room=12 * GIB, tokens=32768) == (FULL, [NONE, SELECTIVE, FULL])


def test_auto_checkpointing_is_none_off_a_gpu():
    assert checkpointing_for_device(AUTO, torch.device("cpu")) == NONE
    assert checkpointing_for_device(AUTO, torch.device("cuda", 0)) == AUTO  # chosen once measured
    assert checkpointing_for_device(FULL, torch.device("cpu")) == FULL
    assert LearnerConfig().activation_checkpointing == AUTO


def test_auto_on_cpu_and_a_number_as_configured():
    model = torch.nn.Linear(2, 2)
    assert resolve_micro_batch_tokens(model, LearnerConfig(), CPU_WORLD, 10, 64, packed=False) == CPU_MICRO_BATCH_TOKENS
    configured = LearnerConfig(micro_batch_tokens="12288")
    assert resolve_micro_batch_tokens(model, configured, CPU_WORLD, 10, 64, packed=True) == 12288


def test_out_of_memory_names_the_keys_to_change():
    with pytest.raises(LearnerOutOfMemory) as raised:
        with out_of_memory_names_keys(32768):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    message = str(raised.value)
    for key in ("learner.micro_batch_tokens", "learner.activation_checkpointing", "learner.cpu_offload", "32768"):
        assert key in message
    assert "Tried to allocate 2.00 GiB" in message and "more detail" not in message
