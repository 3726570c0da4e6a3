"""The GPU memory plan (`asyncrl.memory_plan`), checked against figures worked out by hand: a budget split between the
rollout servers and the learner (the whole card, 80 GiB of a 141 GiB card), the learner's state with LoRA and with full
fine-tuning, its passes sized beside a server and alone, and refusals that give the numbers."""

from __future__ import annotations

import math

import pytest

from asyncrl.memory_plan import (
    AUTO_CHECKPOINTING_TOKENS, MAX_AUTO_TOKENS, SHARED_GPU_USABLE_SHARE, USABLE_SHARE, LearnerRoom, MemoryPlanRefused,
    RAN_OUT, PassMemory, choose_checkpointing, confirmed_tokens, engine_fraction, pass_memory, plan_learner_passes, refuse_unless_state_fits,
    room_for_passes, split_learner_gpu, tokens_that_fit, training_state,
)

MIB, GIB = 2**20, 2**30
H200 = 141 * GIB  # the card's total memory
# Qwen2.5-7B's shape: 7,615,616,512 weights; rank-16 adapters on its seven linear layers add, per decoder layer,
# 16 × (in + out) for q (3584 → 3584), k and v (3584 → 512 each), o (3584 → 3584), gate and up (3584 → 18944 each)
# and down (18944 → 3584): 16 × 90,112 = 1,441,792, over 28 layers 40,370,176
BASE_7B = 7_615_616_512
ADAPTERS_7B = 28 * 16 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))
LORA_RESIDENT = BASE_7B * 2 + ADAPTERS_7B * 4  # the base frozen in bf16, the adapters in float32: 14.34 GiB
FULL_RESIDENT = BASE_7B * 4  # every weight in float32: 28.37 GiB
# Pass memory of the three checkpointing modes of the 7B shape, 2 GiB of it whatever the size
NONE_7B, SELECTIVE_7B, FULL_7B = (PassMemory(per_token=per_token * MIB, fixed=2 * GIB) for per_token in (4.85, 2.5, 0.35))


def test_the_budget_is_split_between_the_servers_and_the_learner_beside_them():
    # 80 GiB of a 141 GiB card, one server at 0.4 of it: 32 GiB for the engine and 1 GiB beyond it; the learner's
    # 1.5 GiB outside its allocator; the learner's allocator holds the 45.5 GiB left
    split = split_learner_gpu(H200, 80, servers=1, server_share=0.4)
    assert split.server_bytes == 32 * GIB
    assert split.learner_bytes == 45.5 * GIB
    assert split.server_bytes + GIB + split.learner_bytes + 1.5 * GIB == 80 * GIB  # the parts add up to the budget
    assert split.engine_fraction == pytest.approx(32 / 141)  # 0.227: what vLLM reads as a share of the whole card
    assert split.learner_fraction == pytest.approx(45.5 / 141)  # 0.323: torch's per-process fraction
    assert engine_fraction(H200, 80, 0.4) == pytest.approx(32 / 141)  # what the server computes from the same budget


def test_the_whole_card_is_the_default_budget():
    split = split_learner_gpu(H200, 0, servers=1, server_share=0.4)
    assert split.server_bytes == pytest.approx(56.4 * GIB, abs=1)  # 0.4 × 141 GiB
    assert split.learner_bytes == pytest.approx((141 - 56.4 - 1 - 1.5) * GIB, abs=1)  # 82.1 GiB
    assert engine_fraction(H200, 0, 0.4) == 0.4  # vLLM's own reading of the share: unchanged
    alone = split_learner_gpu(H200, 0, servers=0, server_share=0.0)
    assert alone.learner_bytes == 139.5 * GIB and alone.usable_share == USABLE_SHARE
    assert split.usable_share == SHARED_GPU_USABLE_SHARE  # beside servers the learner keeps more back
    above = split_learner_gpu(H200, 200, servers=0, server_share=0.0)  # a budget above the card: the card
    assert (above.budget, above.learner_bytes) == (H200, alone.learner_bytes)


def test_a_job_planned_for_an_80_gib_card_gets_the_same_parts_on_a_larger_one():
    on_80 = split_learner_gpu(80 * GIB, 0, servers=1, server_share=0.4)
    on_141 = split_learner_gpu(H200, 80, servers=1, server_share=0.4)
    assert (on_80.server_bytes, on_80.learner_bytes) == (on_141.server_bytes, on_141.learner_bytes)
    assert on_80.engine_fraction == 0.4 and on_141.engine_fraction == pytest.approx(0.4 * 80 / 141)


def test_a_budget_that_leaves_the_learner_nothing_is_refused_with_its_numbers():
    # 4 GiB, a server at 0.4 of it: 1.6 + 1 + 1.5 = 4.1 GiB before the learner
    with pytest.raises(MemoryPlanRefused) as refused:
        split_learner_gpu(H200, 4, servers=1, server_share=0.4)
    message = str(refused.value)
    for part in ("run.gpu_memory_gib=4", "budget 4.0 GiB of the card's 141.0 GiB", "1.6 GiB each",
                 "rollout.engine.gpu_memory_utilization"):
        assert part in message


def test_lora_counts_the_adapters_state_and_full_fine_tuning_every_weight():
    assert ADAPTERS_7B == 40_370_176
    lora = training_state(ADAPTERS_7B, master_itemsize=4, ranks=1, cpu_offload=False)
    assert lora.gradients == 161_480_704 and lora.optimizer == 322_961_408  # 0.15 and 0.30 GiB
    full = training_state(BASE_7B, master_itemsize=4, ranks=1, cpu_offload=False)
    assert full.optimizer == 2 * 4 * BASE_7B == pytest.approx(56.74 * GIB, rel=1e-3)
    sharded = training_state(BASE_7B, master_itemsize=4, ranks=4, cpu_offload=False)
    assert sharded.gradients == BASE_7B and sharded.optimizer == 2 * BASE_7B  # a quarter each on four ranks
    assert training_state(BASE_7B, 4, ranks=1, cpu_offload=True).optimizer == 0  # in CPU memory


def test_full_fine_tuning_of_the_7b_shape_is_refused_in_80_gib_beside_a_server():
    split = split_learner_gpu(H200, 80, servers=1, server_share=0.4)
    state = training_state(BASE_7B, master_itemsize=4, ranks=1, cpu_offload=False)
    room = LearnerRoom(split, resident=FULL_RESIDENT, optimizer=state.optimizer)
    # (45.5 - 28.37) × 0.7 - 56.74 = -44.75 GiB for passes
    assert room.for_passes == pytest.approx(-44.75 * GIB, rel=1e-3)
    with pytest.raises(MemoryPlanRefused) as refused:
        refuse_unless_state_fits(room, state)
    for part in ("45.5 GiB", "28.4 GiB of weights", "56.7 GiB of AdamW state", "28.4 GiB of gradients",
                 "run.gpu_memory_gib=80", "learner.cpu_offload=true", "model.lora.enabled=true"):
        assert part in str(refused.value)
    # over four ranks with the whole card to itself each rank fits: (139.5 - 7.09) × 0.85 - 14.19 = 98.37 GiB
    alone = split_learner_gpu(H200, 0, servers=0, server_share=0.0)
    quarter = training_state(BASE_7B, master_itemsize=4, ranks=4, cpu_offload=False)
    sharded = LearnerRoom(alone, resident=FULL_RESIDENT / 4, optimizer=quarter.optimizer)
    assert sharded.for_passes == pytest.approx(98.37 * GIB, rel=1e-3)
    refuse_unless_state_fits(sharded, quarter)


class FakeProbes:
    """Passes whose memory follows `truth` per mode, though the small probes drew `lines`; records every pass run."""

    def __init__(self, lines: dict[str, PassMemory], truth: dict[str, PassMemory] | None = None) -> None:
        self.lines, self.truth = lines, truth or lines
        self.drawn: list[str | None] = []
        self.passes: list[tuple[str | None, int]] = []

    def line(self, mode: str | None) -> PassMemory:
        self.drawn.append(mode)
        return self.lines[mode]

    def needed(self, mode: str | None, tokens: int) -> float:
        self.passes.append((mode, tokens))
        return self.truth[mode].bytes_for(tokens)


MODES_7B = {"none": NONE_7B, "selective": SELECTIVE_7B, "full": FULL_7B}


def lora_room(budget_gib: float, servers: int) -> LearnerRoom:
    split = split_learner_gpu(H200, budget_gib, servers=servers, server_share=0.4)
    state = training_state(ADAPTERS_7B, master_itemsize=4, ranks=1, cpu_offload=False)
    return LearnerRoom(split, resident=LORA_RESIDENT, optimizer=state.optimizer)


def test_lora_7b_beside_a_server_in_80_gib_recomputes_whole_layers():
    room = lora_room(80, servers=1)
    # (45.5 - 14.34) × 0.7 - 0.30 = 21.51 GiB for passes
    assert room.for_passes == pytest.approx(21.514 * GIB, rel=1e-4)
    probes = FakeProbes(MODES_7B)
    plan = plan_learner_passes(room, probes, tokens=None, modes=tuple(MODES_7B))
    # a pass of 16,384 tokens needs 2 + 77.6 GiB with none, 2 + 40 with selective, 2 + 5.6 with full
    assert plan.checkpointing.mode == "full"
    assert [mode for mode, _ in plan.checkpointing.needed] == ["none", "selective", "full"]
    assert plan.checkpointing.needed[0][1] == pytest.approx(79.59 * GIB, rel=1e-3)
    # (21.51 - 2) GiB / 0.35 MiB = 57,083 tokens, rounded down to 56,320
    assert plan.micro_batch_tokens == 56320
    # full's pass of 16,384 tokens and the micro-batch's own were run before the plan was taken
    assert probes.passes == [("full", AUTO_CHECKPOINTING_TOKENS), ("full", 56320)]


def test_a_pass_that_needs_more_than_its_small_probes_forecast_shrinks_the_micro_batch():
    # the step-3 case, checkpointing set to full: the probes drew 0.35 MiB per token, but a large pass needs 0.5
    room = lora_room(80, servers=1)
    steeper = PassMemory(per_token=0.5 * MIB, fixed=2 * GIB)
    probes = FakeProbes({None: FULL_7B}, {None: steeper})
    plan = plan_learner_passes(room, probes, tokens=None, modes=None)
    # 56,320 tokens needed 2 + 27.5 = 29.5 GiB > 21.51; the line through that pass gives (21.51 - 2) GiB / 0.5 MiB
    # = 39,963 tokens, rounded down to 39,936, whose pass (21.5 GiB) fits
    assert plan.micro_batch_tokens == 39936
    assert probes.passes == [(None, 56320), (None, 39936)]
    # with checkpointing auto, full's pass of 16,384 tokens (10 GiB) already steepens the line: one pass fewer
    auto = FakeProbes(MODES_7B, dict(MODES_7B, full=steeper))
    assert plan_learner_passes(room, auto, tokens=None, modes=tuple(MODES_7B)).micro_batch_tokens == 39936
    assert auto.passes == [("full", AUTO_CHECKPOINTING_TOKENS), ("full", 39936)]


def test_lora_7b_with_the_whole_card_to_itself_keeps_every_activation():
    room = lora_room(0, servers=0)
    # (139.5 - 14.34) × 0.85 - 0.30 = 106.09 GiB: none's pass of 16,384 tokens (79.6 GiB) fits
    assert room.for_passes == pytest.approx(106.089 * GIB, rel=1e-4)
    probes = FakeProbes(MODES_7B)
    plan = plan_learner_passes(room, probes, tokens=None, modes=tuple(MODES_7B))
    assert plan.checkpointing.mode == "none" and probes.drawn == ["none"]  # the other modes are never measured
    assert plan.micro_batch_tokens == 21504  # (106.09 - 2) GiB / 4.85 MiB = 21,977, rounded down


def test_full_fine_tuning_of_a_small_model_beside_a_server_on_an_80_gib_card():
    # 494,032,768 weights (the 0.5B shape) in float32 (1.84 GiB), and two bf16 copies rank 0 holds for the server
    # beside it (0.92 GiB each): the gathered weights and the CUDA IPC buffer the server maps
    weights = 494_032_768
    split = split_learner_gpu(80 * GIB, 0, servers=1, server_share=0.4)
    state = training_state(weights, master_itemsize=4, ranks=1, cpu_offload=False)
    room = LearnerRoom(split, resident=weights * 4 + 2 * weights * 2, optimizer=state.optimizer)
    # (45.5 - 3.68) × 0.7 - 3.68 = 25.59 GiB
    assert room.for_passes == pytest.approx(25.593 * GIB, rel=1e-4)
    refuse_unless_state_fits(room, state)
    probes = FakeProbes({None: PassMemory(per_token=0.6 * MIB, fixed=3 * GIB)})
    plan = plan_learner_passes(room, probes, tokens=None, modes=None)  # a fixed checkpointing mode
    assert plan.checkpointing is None
    assert plan.micro_batch_tokens == 37888  # (25.59 - 3) GiB / 0.6 MiB = 38,558, rounded down
    assert probes.passes == [(None, 37888)]


def test_a_configured_micro_batch_is_kept_and_only_the_mode_is_chosen():
    probes = FakeProbes(MODES_7B)
    plan = plan_learner_passes(lora_room(80, servers=1), probes, tokens=8192, modes=tuple(MODES_7B))
    # 8,192 tokens: none 2 + 38.8 GiB, selective 2 + 20 = 22 GiB (> 21.51), full 4.8 GiB
    assert (plan.micro_batch_tokens, plan.checkpointing.mode) == (8192, "full")
    assert probes.passes == [("full", 8192)]


def test_a_budget_too_small_for_one_pass_is_refused_with_its_numbers():
    # 34 GiB, a server at 0.4 of it: the learner has 34 - 13.6 - 1 - 1.5 = 17.9 GiB, (17.9 - 14.34) × 0.7 - 0.3 =
    # 2.19 GiB for passes, and full's 2 GiB + 0.35 MiB per token fits 572 tokens
    room = lora_room(34, servers=1)
    with pytest.raises(MemoryPlanRefused) as refused:
        plan_learner_passes(room, FakeProbes(MODES_7B), tokens=None, modes=tuple(MODES_7B))
    message = str(refused.value)
    for part in ("learner.micro_batch_tokens=auto", "1024 tokens", "2.2 GiB for passes", "the learner's 17.9 GiB",
                 "14.3 GiB of weights", "0.35 MiB per token", "run.gpu_memory_gib=34", "learner.activation_checkpointing=full"):
        assert part in message
    # 36 GiB leave (19.1 - 14.34) × 0.7 - 0.3 = 3.03 GiB: 2,048 tokens
    assert plan_learner_passes(lora_room(36, servers=1), FakeProbes(MODES_7B), None, tuple(MODES_7B)).micro_batch_tokens == 2048


def test_passes_that_keep_needing_more_are_refused_after_the_last_confirmation():
    steeper = {None: PassMemory(per_token=0.5 * MIB, fixed=2 * GIB)}
    probes = FakeProbes(steeper, {None: PassMemory(per_token=0.5 * MIB, fixed=20 * GIB)})  # a fixed cost the probes missed
    with pytest.raises(MemoryPlanRefused, match="passes of 39936 tokens needed 39.5 GiB"):
        plan_learner_passes(lora_room(80, servers=1), probes, tokens=None, modes=None)
    assert probes.passes[0] == (None, 39936)


# The line through two probes, the room and the fit (figures as the learner has always planned them)

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
LINES = {"none": PassMemory(per_token=MIB, fixed=4 * GIB), "selective": PassMemory(per_token=MIB / 2, fixed=4 * GIB),
         "full": PassMemory(per_token=MIB / 8, fixed=4 * GIB)}


def choose(room: float, tokens: int = 16384) -> tuple[str, list[str]]:
    """The chosen mode and the modes measured to choose it (in order)."""
    measured = []

    def lines():
        for mode, line in LINES.items():
            measured.append(mode)
            yield mode, line

    return choose_checkpointing(lines(), room, tokens).mode, measured


def test_auto_checkpointing_keeps_every_activation_while_a_pass_fits():
    assert choose(room=20 * GIB) == ("none", ["none"])  # exactly 20 GiB: fits, and nothing else is measured
    assert choose(room=60 * GIB) == ("none", ["none"])


def test_auto_checkpointing_recomputes_elementwise_work_when_none_does_not_fit():
    assert choose(room=20 * GIB - 1) == ("selective", ["none", "selective"])  # one byte short for none
    assert choose(room=12 * GIB) == ("selective", ["none", "selective"])  # exactly selective's 12 GiB


def test_auto_checkpointing_recomputes_whole_layers_when_selective_does_not_fit():
    assert choose(room=12 * GIB - 1) == ("full", ["none", "selective", "full"])
    assert choose(room=6 * GIB) == ("full", ["none", "selective", "full"])
    # full is the least memory there is: chosen even where its pass does not fit (the micro-batch shrinks instead)
    choice = choose_checkpointing(iter(LINES.items()), 5 * GIB, 16384)
    assert choice.mode == "full" and choice.line == LINES["full"]
    assert choice.needed == [("none", 20 * GIB), ("selective", 12 * GIB), ("full", 6 * GIB)]


def test_auto_checkpointing_fits_a_configured_micro_batch():
    # 32,768 tokens: none needs 36 GiB, selective 20 GiB, full 8 GiB
    assert choose(room=36 * GIB, tokens=32768) == ("none", ["none"])
    assert choose(room=30 * GIB, tokens=32768) == ("selective", ["none", "selective"])
    assert choose(room=12 * GIB, tokens=32768) == ("full", ["none", "selective", "full"])


def test_a_mode_whose_pass_needs_more_than_its_line_says_does_not_fit():
    # none's line says 20 GiB for 16,384 tokens, but the pass itself needs 21: selective is chosen
    choice = choose_checkpointing(iter(LINES.items()), 20 * GIB, 16384,
                                  confirm=lambda mode, tokens: 21 * GIB if mode == "none" else LINES[mode].bytes_for(tokens))
    assert choice.mode == "selective"
    assert choice.needed == [("none", 21 * GIB), ("selective", 12 * GIB)]


def test_a_mode_whose_probe_ran_out_of_memory_fits_no_pass_and_the_next_mode_is_tried():
    # the 7B shape with LoRA ran out of memory in its 4,096-token probe without checkpointing: a measure, not a crash
    assert pass_memory((2048, 4096), [10 * GIB, math.inf], resident=0, saved=[GIB, 2 * GIB]) == RAN_OUT
    assert tokens_that_fit(RAN_OUT, 80 * GIB) == 0
    lines = iter([("none", RAN_OUT), ("selective", LINES["selective"])])
    choice = choose_checkpointing(lines, 20 * GIB, 16384, confirm=lambda mode, tokens: LINES[mode].bytes_for(tokens))
    assert choice.mode == "selective" and choice.needed == [("none", math.inf), ("selective", 12 * GIB)]


def test_a_confirming_pass_that_runs_out_of_memory_ends_in_a_refusal_that_says_so():
    room = LearnerRoom(split_learner_gpu(80 * GIB, 0, servers=0, server_share=0.0), resident=0, optimizer=0)
    with pytest.raises(MemoryPlanRefused, match=r"tokens needed more than the GPU had \(out of memory\)"):
        confirmed_tokens(LINES["full"], room, needed=lambda tokens: math.inf)
