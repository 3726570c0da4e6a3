"""GPU memory and the micro-batch: `learner.micro_batch_tokens: auto` measured on the model itself, and an
out-of-memory error that names the keys to change.

Auto sizing runs two probe passes (forward and backward of packed synthetic samples, `PROBE_TOKENS`) on
every rank before training. Their peak memories fit a line, fixed + per_token · tokens; the budget is then
the largest token count whose peak, plus the optimizer state that the first step will allocate, stays
within `USABLE_SHARE` of the memory free on the device. Ranks take the smallest budget of any rank.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from asyncrl.config.learner import LearnerConfig
from learner.distributed import World
from learner.logprobs import target_logprobs

log = logging.getLogger(__name__)

CPU_MICRO_BATCH_TOKENS = 8192  # `auto` on CPU, where there is no device memory to measure
PROBE_TOKENS = (2048, 4096)  # tokens of the two probe passes
PROBE_SAMPLE_TOKENS = 1024  # tokens per probe sample (shorter where the model's context is shorter)
USABLE_SHARE = 0.85  # of the device memory free for the learner: the rest absorbs allocator fragmentation
# on a GPU shared with rollout servers: the learner also absorbs the servers going past their share (vLLM held
# 0.6 GiB over it on an H100) and fragmentation under a mix of batch shapes (4.2 GiB seen at 30k-token passes)
SHARED_GPU_USABLE_SHARE = 0.7
ROUND_TO = 1024  # budgets are whole multiples of this
MAX_AUTO_TOKENS = 65536  # beyond this a larger micro-batch buys no speed, only memory
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


def resolve_micro_batch_tokens(model: torch.nn.Module, settings: LearnerConfig, world: World, vocab: int,
                               context: int, packed: bool, servers_share: float = 0.0) -> int:
    """`learner.micro_batch_tokens` as a number: the configured one, or measured (auto); every rank must call.
    `servers_share`: the share of this GPU's memory that rollout servers on it take (a colocated job), left free
    whether or not they have started yet."""
    configured = settings.micro_batch_budget()
    if configured is not None:
        return configured
    if world.device.type != "cuda":
        log.info("learner.micro_batch_tokens=auto on CPU: %d tokens", CPU_MICRO_BATCH_TOKENS)
        return CPU_MICRO_BATCH_TOKENS
    sample = min(PROBE_SAMPLE_TOKENS, context)
    resident = torch.cuda.memory_allocated(world.device)  # weights (and anything else already held)
    peaks, saved = zip(*[_probe(model, tokens, sample, vocab, world, packed) for tokens in PROBE_TOKENS])
    free, total = torch.cuda.mem_get_info(world.device)
    available = free + torch.cuda.memory_reserved(world.device) - torch.cuda.memory_allocated(world.device)
    usable = USABLE_SHARE
    if servers_share:
        available = min(available, total * (1 - servers_share) - torch.cuda.memory_allocated(world.device))
        usable = SHARED_GPU_USABLE_SHARE
    optimizer_state = 0 if settings.cpu_offload else ADAM_STATES * _local_parameter_bytes(model)
    fit = fit_budget(PROBE_TOKENS, list(peaks), resident, available, optimizer_state, usable, list(saved))
    tokens = _smallest_across_ranks(fit.tokens, world)
    if tokens < ROUND_TO:
        raise LearnerOutOfMemory(
            f"learner.micro_batch_tokens=auto: the model leaves room for fewer than {ROUND_TO} tokens per pass "
            f"({available / 2**30:.1f} GiB free, {fit.per_token / 2**20:.2f} MiB per token): set "
            f"learner.activation_checkpointing=full or learner.cpu_offload=true, or use more learner GPUs")
    log.info("learner.micro_batch_tokens=auto: %d tokens (%.2f MiB per token, %.1f GiB for gradients and "
             "gathered weights, %.1f GiB for optimizer state, of %.1f GiB free)", tokens, fit.per_token / 2**20,
             fit.fixed / 2**30, optimizer_state / 2**30, available / 2**30)
    return tokens


@dataclass(frozen=True)
class BudgetFit:
    tokens: int  # largest micro-batch that fits, a multiple of ROUND_TO (0 when not even that fits)
    per_token: float  # bytes of peak memory per token of a pass
    fixed: float  # bytes of peak memory a pass needs beyond the resident weights whatever its size


def fit_budget(probe_tokens: tuple[int, int], peaks: list[float], resident: float, available: float,
               optimizer_state: float, usable_share: float = USABLE_SHARE, saved: list[float] | None = None) -> BudgetFit:
    """The largest token count t with fixed + per_token · t + optimizer_state ≤ usable_share · available,
    rounded down to ROUND_TO and capped at MAX_AUTO_TOKENS. per_token is the steeper of two slopes between the
    probes: of their peaks, and of what their forward passes left `saved` for the backward (the peak of a small
    probe may not grow with its tokens at all); fixed is what the peaks need beyond that line."""
    slopes = [(later - first) / (probe_tokens[1] - probe_tokens[0]) for first, later in (peaks, saved or peaks)]
    per_token = max(*slopes, 1.0)
    fixed = max(max(peak - resident - per_token * tokens for peak, tokens in zip(peaks, probe_tokens)), 0.0)
    room = (available * usable_share - optimizer_state - fixed) / per_token
    tokens = int(max(min(room, MAX_AUTO_TOKENS), 0)) // ROUND_TO * ROUND_TO
    return BudgetFit(tokens=tokens, per_token=per_token, fixed=fixed)


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
    """Bytes of this rank's shard of the weights (what each optimizer moment matches)."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total


def _smallest_across_ranks(value: int, world: World) -> int:
    if world.size == 1:
        return value
    packed = torch.tensor([value], dtype=torch.long, device=world.device)
    dist.all_reduce(packed, op=dist.ReduceOp.MIN)
    return int(packed.item())
