"""A learner rank's memory: off a GPU no budget applies (the CPU's auto values, no allocator to hold, no peaks to log);
on one (its calls stood in for) the allocator held to the learner's part, the plan wired to what the rank holds, the
weights it holds for the servers; the checkpointing mode auto means per device, and an out-of-memory error that
names the keys to change. The plan itself, with its figures, is `tests/unit/asyncrl/test_memory_plan.py`."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import AsyncRLConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.memory_plan import MemoryPlanRefused, PassMemory, split_learner_gpu
from learner.distributed import World
from learner.policy.activation_checkpointing import (
    AUTO, FULL, NONE, CheckpointingSwitch, attach_switch, checkpointing_for_device, checkpointing_switch,
)
from learner.policy.memory import (
    CPU_MICRO_BATCH_TOKENS, LearnerOutOfMemory, hold_to_part, out_of_memory_names_keys, peak_memory_metrics,
    resolve_micro_batch_tokens,
)
from learner.policy.policy_model import weights_held_for_servers

GIB, MIB = 2**30, 2**20
CPU_WORLD = World(rank=0, size=1, device=torch.device("cpu"))
CUDA_WORLD = World(rank=0, size=1, device=torch.device("cuda", 0))  # a device name only: nothing runs on it here


def test_auto_checkpointing_is_none_off_a_gpu():
    assert checkpointing_for_device(AUTO, torch.device("cpu")) == NONE
    assert checkpointing_for_device(AUTO, torch.device("cuda", 0)) == AUTO  # chosen once measured
    assert checkpointing_for_device(FULL, torch.device("cpu")) == FULL
    assert LearnerConfig().activation_checkpointing == AUTO


def test_no_budget_applies_on_cpu():
    assert hold_to_part(CPU_WORLD, budget_gib=80, servers=1, server_share=0.4) is None
    assert peak_memory_metrics(CPU_WORLD) == {}


def test_auto_on_cpu_and_a_number_as_configured():
    model = torch.nn.Linear(2, 2)
    assert resolve_micro_batch_tokens(model, LearnerConfig(), CPU_WORLD, 10, 64, packed=False,
                                      split=None) == CPU_MICRO_BATCH_TOKENS
    configured = LearnerConfig(micro_batch_tokens="12288")
    assert resolve_micro_batch_tokens(model, configured, CPU_WORLD, 10, 64, packed=True, split=None) == 12288


def test_out_of_memory_names_the_keys_to_change():
    with pytest.raises(LearnerOutOfMemory) as raised:
        with out_of_memory_names_keys(32768):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    message = str(raised.value)
    for key in ("learner.micro_batch_tokens", "learner.activation_checkpointing", "learner.cpu_offload",
                "run.gpu_memory_gib", "32768"):
        assert key in message
    assert "Tried to allocate 2.00 GiB" in message and "more detail" not in message


def test_on_a_gpu_the_allocator_is_held_to_the_learners_part(monkeypatch):
    held = []
    monkeypatch.setattr("learner.policy.memory.card_bytes", lambda device: 141 * GIB)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device: held.append(fraction))
    split = hold_to_part(CUDA_WORLD, budget_gib=80, servers=1, server_share=0.4)
    assert split.learner_bytes == 45.5 * GIB  # 80 - 32 - 1 - 1.5
    assert held == [pytest.approx(45.5 / 141)]


class LinearProbes:
    """Stands in for the probe passes: every mode's pass needs 2 GiB and 1 MiB per token."""

    def __init__(self, model, world, vocab, sample, packed, resident, switch) -> None:
        self.resident, self.passes = resident, []

    def line(self, mode):
        return PassMemory(per_token=MIB, fixed=2 * GIB)

    def needed(self, mode, tokens):
        self.passes.append((mode, tokens))
        return 2 * GIB + tokens * MIB


def test_on_a_gpu_auto_plans_in_the_part_less_the_weights_held_and_the_copy_for_the_servers(monkeypatch):
    model = torch.nn.Linear(1024, 1024)  # 1,049,600 trained float32 weights: 8.0 MiB of AdamW state
    attach_switch(model, CheckpointingSwitch())  # checkpointing auto
    made: list[LinearProbes] = []
    monkeypatch.setattr("learner.policy.memory.ModelProbes", lambda *args: made.append(LinearProbes(*args)) or made[-1])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    split = split_learner_gpu(80 * GIB, 0, servers=1, server_share=0.4)  # the learner's 45.5 GiB
    tokens = resolve_micro_batch_tokens(model, LearnerConfig(), CUDA_WORLD, 10, 4096, packed=True, split=split,
                                        held_for_servers=GIB)
    # (45.5 - 10 - 1) × 0.7 - 8.0 MiB = 24.142 GiB; none's pass of 16,384 tokens (18 GiB) fits and is run; then
    # (24.142 - 2) GiB / 1 MiB = 22,673 tokens, rounded down to 22,528, and a pass of them
    assert tokens == 22528
    assert checkpointing_switch(model).mode == NONE
    assert made[0].resident == 10 * GIB  # passes are measured beyond what the weights hold
    assert made[0].passes == [("none", 16384), ("none", 22528)]


def test_on_a_gpu_a_configured_micro_batch_still_needs_room_for_the_training_state(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 46 * GIB)  # more than the learner's part
    split = split_learner_gpu(80 * GIB, 0, servers=1, server_share=0.4)
    configured = LearnerConfig(micro_batch_tokens="8192", activation_checkpointing=FULL)
    with pytest.raises(MemoryPlanRefused, match=r"45.5 GiB holds 46.0 GiB of weights"):
        resolve_micro_batch_tokens(torch.nn.Linear(2, 2), configured, CUDA_WORLD, 10, 64, packed=True, split=split)


@pytest.mark.parametrize(("backend", "servers_beside", "rank", "copies"), [
    ("ipc", 1, 0, 2),  # the gathered weights and the CUDA IPC buffer the server beside maps
    ("auto", 1, 0, 2),  # auto: nccl sends from the GPU, ipc beside the learner
    ("nccl", 0, 0, 1),  # servers apart: the gathered weights alone, sent from the GPU
    ("gloo", 1, 0, 0),  # through CPU memory
    ("ipc", 1, 1, 0),  # only rank 0 holds them
])
def test_the_weights_held_for_the_servers(backend, servers_beside, rank, copies, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # what `auto` asks of a GPU learner (`sees_cuda`)
    config = AsyncRLConfig()
    config.rollout.weight_sync.backend = backend
    model = torch.nn.Linear(4, 4)  # 20 weights, served in model.dtype (float32): 80 bytes
    world = World(rank=rank, size=2, device=torch.device("cuda", 0))
    assert weights_held_for_servers(config, model, world, servers_beside) == copies * 80


def test_a_probe_pass_that_runs_out_of_gpu_memory_is_measured_as_needing_more_than_there_is(monkeypatch):
    from learner.policy.memory import ModelProbes

    emptied = []
    for name, value in {"synchronize": None, "reset_peak_memory_stats": None, "memory_allocated": 0}.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, value=value: value)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.02 GiB")

    monkeypatch.setattr("learner.policy.memory.target_logprobs", out_of_memory)
    model = torch.nn.Linear(4, 4)
    probes = ModelProbes(model, CPU_WORLD, vocab=10, sample=8, packed=True, resident=0, switch=CheckpointingSwitch())

    assert probes.line("none").ran_out  # the plan then tries the next mode
    assert probes.needed("full", 4096) == float("inf")
    assert emptied  # the failed pass's blocks were handed back before the next probe


def test_the_plan_records_the_mode_the_layers_run_in(tmp_path):
    from asyncrl.learner_plan import LearnerPlan, read_plan, write_plan
    from learner.policy.activation_checkpointing import checkpointing_mode

    fixed, chosen = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    switch = CheckpointingSwitch()
    switch.mode = FULL  # auto's choice, as the plan on a GPU sets it
    attach_switch(chosen, switch)
    assert checkpointing_mode(chosen, AUTO, CUDA_WORLD.device) == FULL
    assert checkpointing_mode(fixed, AUTO, CPU_WORLD.device) == NONE  # auto off a GPU
    assert checkpointing_mode(fixed, FULL, CPU_WORLD.device) == FULL
    write_plan(tmp_path, LearnerPlan(micro_batch_tokens=20480, packed=True, activation_checkpointing=FULL))
    assert read_plan(tmp_path) == LearnerPlan(20480, True, FULL)
    (tmp_path / "learner_plan.json").write_text('{"micro_batch_tokens": 1}')  # a field missing: not a plan
    assert read_plan(tmp_path) is None and read_plan(tmp_path / "absent") is None
