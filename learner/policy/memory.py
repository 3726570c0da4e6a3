"""GPU memory and the micro-batch: `learner.micro_batch_tokens: auto` and `learner.activation_checkpointing: auto`
measured on the model itself, and an out-of-memory error that names the keys to change.

Auto sizing runs two probe passes (forward and backward of packed synthetic samples, `PROBE_TOKENS`) on
every rank before training. Their peak memories fit a line, fixed + per_token · tokens; the budget is then
the largest token count whose peak, plus the optimizer state that the first step will allocate, stays
within `USABLE_SHARE` of the memory free on the device. Ranks agree on the worst line and the least room.

Checkpointing `auto` probes the modes cheapest first (none, selective, full) and keeps the first whose pass
fits: a pass of `learner.micro_batch_tokens` tokens, or of `AUTO_CHECKPOINTING_TOKENS` when those are auto.
The micro-batch is then sized from the chosen mode's line, so nothing is probed twice.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from asyncrl.config.learner import LearnerConfig
from learner.distributed import World
from learner.maths.logprobs import target_logprobs
from learner.policy.activation_checkpointing import MODES, CheckpointingSwitch, checkpointing_switch

log = logging.getLogger(__name__)

GIB = 2**30
CPU_MICRO_BATCH_TOKENS = 8192  # `auto` on CPU, where there is no device memory to measure
PROBE_TOKENS = (2048, 4096)  # tokens of the two probe passes
PROBE_SAMPLE_TOKENS = 1024  # tokens per probe sample (shorter where the model's context is shorter)
USABLE_SHARE = 0.85  # of the device memory free for the learner: the rest absorbs allocator fragmentation
# on a GPU shared with rollout servers: the learner also absorbs the servers going past their share (vLLM held
# 0.6 GiB over it on an H100) and fragmentation under a mix of batch shapes (4.2 GiB seen at 30k-token passes)
SHARED_GPU_USABLE_SHARE = 0.7
ROUND_TO = 1024  # budgets are whole multiples of this
MAX_AUTO_TOKENS = 65536  # beyond this a larger micro-batch buys no speed, only memory
# Checkpointing auto with micro-batches auto: the pass a mode must fit. Below it a smaller pass loses more than
# recomputing costs: the 3B shape on an H200 ran 44.0 % MFU with none at 16,384 tokens against 39.4 % with
# selective at 32,768, and on an H100, where none did not fit, 34.1 % with full against 26.3 % with selective.
AUTO_CHECKPOINTING_TOKENS = 16384
ADAM_STATES = 2  # AdamW keeps two moments per weight, in the weight's dtype


class LearnerOutOfMemory(RuntimeError):
    """A forward or backward pass ran out of GPU memory; the message names the settings to change."""


@contextlib.contextmanager
def out_of_memory_names_keys(micro_batch_tokens: int) -> Iterator[None]:
    """Turn a CUDA out-of-memory error inside the block into one that says which keys lower memory."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        raise LearnerOutOfMemory(
            f"GPU out of memory in a micro-batch of up to {micro_batch_tokens} tokens: lower "
            f"learner.micro_batch_tokens (or set it to auto), or set learner.activation_checkpointing to "
            f"selective or full; learner.cpu_offload=true moves optimizer state off the GPU "
            f"({str(error).splitlines()[0]})"
        ) from None


@dataclass(frozen=True)
class PassMemory:
    """Peak memory of a forward and backward pass beyond the resident weights, as a line in its tokens."""

    per_token: float  # bytes of peak memory per token of a pass
    fixed: float  # bytes a pass needs whatever its size (gradients, gathered weights)

    def bytes_for(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


@dataclass(frozen=True)
class CheckpointingChoice:
    mode: str  # the chosen mode, one of MODES
    line: PassMemory  # its measured pass memory
    needed: list[tuple[str, float]]  # (mode, bytes a pass needs) of every mode tried, in order


def resolve_micro_batch_tokens(model: torch.nn.Module, settings: LearnerConfig, world: World, vocab: int,
                               context: int, packed: bool, servers_share: float = 0.0) -> int:
    """`learner.micro_batch_tokens` as a number: the configured one, or measured (auto); every rank must call.
    A model sharded with checkpointing `auto` on a GPU gets its mode here too, from the same probes.
    `servers_share`: the share of this GPU's memory that rollout servers on it take (a colocated job), left free
    whether or not they have started yet."""
    configured = settings.micro_batch_budget()
    switch = checkpointing_switch(model)
    if configured is not None and switch is None:
        return configured
    if world.device.type != "cuda":
        log.info("learner.micro_batch_tokens=auto on CPU: %d tokens", CPU_MICRO_BATCH_TOKENS)
        return CPU_MICRO_BATCH_TOKENS
    resident = torch.cuda.memory_allocated(world.device)  # weights (and anything else already held)

    def measured(mode: str | None) -> PassMemory:
        if mode is not None:
            switch.mode = mode
        return _measure_passes(model, world, vocab, min(PROBE_SAMPLE_TOKENS, context), packed, resident)

    line = measured(MODES[0] if switch else None)
    room = _room_for_passes(model, settings, world, servers_share)  # after a probe: its cached blocks count as free
    if switch is not None:
        line = _choose_for(switch, line, measured, room, configured or AUTO_CHECKPOINTING_TOKENS)
    if configured is not None:
        return configured
    tokens = tokens_that_fit(line, room)
    if tokens < ROUND_TO:
        raise LearnerOutOfMemory(
            f"learner.micro_batch_tokens=auto: the model leaves room for fewer than {ROUND_TO} tokens per pass "
            f"({room / GIB:.1f} GiB free for passes, {line.per_token / 2**20:.2f} MiB per token): set "
            f"learner.activation_checkpointing=full or learner.cpu_offload=true, or use more learner GPUs")
    log.info("learner.micro_batch_tokens=auto: %d tokens (%.2f MiB per token, %.1f GiB for gradients and "
             "gathered weights, of %.1f GiB free for passes beside the optimizer state)", tokens,
             line.per_token / 2**20, line.fixed / GIB, room / GIB)
    return tokens


def _choose_for(switch: CheckpointingSwitch, first: PassMemory, measured: Callable[[str], PassMemory], room: float,
                tokens: int) -> PassMemory:
    """Checkpointing `auto`: `first` is none's line; the other modes are measured only if needed. Sets the switch."""
    lines = itertools.chain([(MODES[0], first)], ((mode, measured(mode)) for mode in MODES[1:]))
    choice = choose_checkpointing(lines, room, tokens)
    switch.mode = choice.mode
    needs = ", ".join(f"{mode} {needed / GIB:.1f} GiB" for mode, needed in choice.needed)
    log.info("learner.activation_checkpointing=auto: %s (a pass of %d tokens needs %s; %.1f GiB free for passes)",
             choice.mode, tokens, needs, room / GIB)
    return choice.line


def choose_checkpointing(lines: Iterable[tuple[str, PassMemory]], room: float, tokens: int) -> CheckpointingChoice:
    """The first of `lines` ((mode, its pass memory), cheapest mode first) whose pass of `tokens` tokens fits in
    `room` bytes; the last (the least memory) when none does. `lines` is read lazily: a mode is measured only
    when every mode before it failed to fit."""
    needed: list[tuple[str, float]] = []
    for mode, line in lines:
        needed.append((mode, line.bytes_for(tokens)))
        if line.bytes_for(tokens) <= room:
            break
    return CheckpointingChoice(mode, line, needed)


def pass_memory(probe_tokens: tuple[int, int], peaks: list[float], resident: float,
                saved: list[float] | None = None) -> PassMemory:
    """The line through two probes. per_token is the steeper of two slopes between them: of their peaks, and of
    what their forward passes left `saved` for the backward (the peak of a small probe may not grow with its
    tokens at all); fixed is what the peaks need beyond that line and the `resident` weights."""
    slopes = [(later - first) / (probe_tokens[1] - probe_tokens[0]) for first, later in (peaks, saved or peaks)]
    per_token = max(*slopes, 1.0)
    fixed = max(max(peak - resident - per_token * tokens for peak, tokens in zip(peaks, probe_tokens)), 0.0)
    return PassMemory(per_token=per_token, fixed=fixed)


def room_for_passes(available: float, optimizer_state: float, usable_share: float = USABLE_SHARE) -> float:
    """Bytes left for a pass: `usable_share` of the `available` device memory, less the optimizer state to come."""
    return available * usable_share - optimizer_state


def tokens_that_fit(line: PassMemory, room: float) -> int:
    """The largest token count whose pass fits in `room`, rounded down to ROUND_TO, capped at MAX_AUTO_TOKENS (0
    when not even ROUND_TO fits)."""
    tokens = (room - line.fixed) / line.per_token
    return int(max(min(tokens, MAX_AUTO_TOKENS), 0)) // ROUND_TO * ROUND_TO


def _measure_passes(model: torch.nn.Module, world: World, vocab: int, sample: int, packed: bool,
                    resident: float) -> PassMemory:
    """The two probes' line on this rank, then the worst of every rank's (each rank's own layers and shards)."""
    peaks, saved = zip(*[_probe(model, tokens, sample, vocab, world, packed) for tokens in PROBE_TOKENS])
    line = pass_memory(PROBE_TOKENS, list(peaks), resident, list(saved))
    per_token, fixed = _across_ranks([line.per_token, line.fixed], world, dist.ReduceOp.MAX)
    return PassMemory(per_token=per_token, fixed=fixed)


def _room_for_passes(model: torch.nn.Module, settings: LearnerConfig, world: World, servers_share: float) -> float:
    """This GPU's room for a pass (`room_for_passes`), the least of any rank's."""
    free, total = torch.cuda.mem_get_info(world.device)
    allocated = torch.cuda.memory_allocated(world.device)
    available = free + torch.cuda.memory_reserved(world.device) - allocated
    usable = USABLE_SHARE
    if servers_share:
        available = min(available, total * (1 - servers_share) - allocated)
        usable = SHARED_GPU_USABLE_SHARE
    optimizer_state = 0 if settings.cpu_offload else ADAM_STATES * _local_parameter_bytes(model)
    (room,) = _across_ranks([room_for_passes(available, optimizer_state, usable)], world, dist.ReduceOp.MIN)
    return room


def _probe(model: torch.nn.Module, tokens: int, sample: int, vocab: int, world: World, packed: bool) -> tuple[float, float]:
    """One forward and backward of `tokens` random tokens, gradients dropped after: (peak bytes allocated, bytes the
    forward left allocated for the backward). The second grows with the tokens even where the first does not: a
    large model's peak comes at the end of the backward, when its gradients are complete and a small probe's
    activations are gone (a 3B model peaked equally at 2,048 and 4,096 tokens)."""
    rows = max(1, tokens // sample)
    generator = torch.Generator(device="cpu").manual_seed(0)
    input_ids = torch.randint(0, vocab, (rows, sample), generator=generator).to(world.device)  # [rows, sample]
    attention_mask = torch.ones_like(input_ids)  # [rows, sample]
    torch.cuda.synchronize(world.device)
    torch.cuda.reset_peak_memory_stats(world.device)
    before = torch.cuda.memory_allocated(world.device)
    with out_of_memory_names_keys(tokens):
        logprobs, _ = target_logprobs(model, input_ids, attention_mask, packed=packed)  # [rows, sample-1]
        saved = torch.cuda.memory_allocated(world.device) - before
        logprobs.mean().backward()
    peak = torch.cuda.max_memory_allocated(world.device)
    model.zero_grad(set_to_none=True)
    return float(peak), float(saved)


def _local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's shard of the trained weights (what each optimizer moment matches; with LoRA the
    adapters alone)."""
    total = 0
    for parameter in (p for p in model.parameters() if p.requires_grad):
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total


def _across_ranks(values: list[float], world: World, op: dist.ReduceOp) -> list[float]:
    """`values` reduced element-wise over every rank with `op` (as they are on one rank)."""
    if world.size == 1:
        return values
    packed = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(packed, op=op)
    return packed.tolist()
