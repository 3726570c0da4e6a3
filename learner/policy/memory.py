"""GPU memory on a learner rank: its part of the GPU under the job's budget, held there; `learner.micro_batch_tokens:
auto` and `learner.activation_checkpointing: auto` planned inside that part (`asyncrl.memory_plan`) from passes
measured on the model itself; the peak memory of each step; and an out-of-memory error that names the keys to change.

Auto sizing runs two probe passes (forward and backward of packed synthetic samples, `PROBE_TOKENS`) on every rank
before training, per checkpointing mode tried (none, selective, full: the cheapest first), and then one pass of the
size the plan chose, which must fit as forecast. Ranks agree on the steepest line, the largest pass and the most
memory held, so all plan alike. On CPU no budget applies: auto is CPU_MICRO_BATCH_TOKENS.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.config.learner import LearnerConfig
from asyncrl.memory_plan import (
    GpuSplit, LearnerRoom, PassMemory, gib, pass_memory, plan_learner_passes, refuse_unless_state_fits,
    split_learner_gpu, training_state,
)
from asyncrl.units import BYTES_PER_GIB
from learner.distributed import World
from learner.maths.logprobs import target_logprobs
from learner.policy.activation_checkpointing import MODES, CheckpointingSwitch, checkpointing_switch

log = logging.getLogger(__name__)

CPU_MICRO_BATCH_TOKENS = 8192  # `auto` on CPU, where there is no device memory to plan
PROBE_TOKENS = (2048, 4096)  # tokens of the two probe passes that draw a mode's line
PROBE_SAMPLE_TOKENS = 1024  # tokens per probe sample (shorter where the model's context is shorter)


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
            f"selective or full; learner.cpu_offload=true moves optimizer state off the GPU; run.gpu_memory_gib "
            f"and rollout.engine.gpu_memory_utilization set the learner's part of the GPU "
            f"({str(error).splitlines()[0]})"
        ) from None


def hold_to_part(world: World, budget_gib: float, servers: int, server_share: float) -> GpuSplit | None:
    """This rank's part of its GPU under the job's budget (`run.gpu_memory_gib`) beside `servers` rollout servers
    that each take `server_share` of it; the rank's allocator is held to that part from now on. None on CPU: no
    budget applies there. Call before the rank allocates anything on its GPU."""
    if world.device.type != "cuda":
        return None
    split = split_learner_gpu(card_bytes(world.device), budget_gib, servers, server_share)
    torch.cuda.set_per_process_memory_fraction(split.learner_fraction, world.device)
    log.info("%s", split.describe())
    return split


def card_bytes(device: torch.device) -> int:
    """The GPU's total memory, as its allocator counts it."""
    return torch.cuda.get_device_properties(device).total_memory


def resolve_micro_batch_tokens(model: torch.nn.Module, settings: LearnerConfig, world: World, vocab: int,
                               context: int, packed: bool, split: GpuSplit | None, held_for_servers: int = 0) -> int:
    """`learner.micro_batch_tokens` as a number: the configured one, or planned in this rank's part of the GPU
    (`split`; None on CPU); every rank must call. On a GPU a part that cannot hold the training state is refused
    first, whatever is configured. A model sharded with checkpointing `auto` on a GPU gets its mode here too, from
    the same passes. `held_for_servers`: bytes of weights this rank holds on its GPU for the rollout servers between
    syncs (`weights_held_for_servers`), counted with the weights."""
    configured = settings.micro_batch_budget()
    if split is None:
        if configured is None:
            log.info("learner.micro_batch_tokens=auto on CPU: %d tokens", CPU_MICRO_BATCH_TOKENS)
        return configured or CPU_MICRO_BATCH_TOKENS
    allocated = torch.cuda.memory_allocated(world.device)  # weights (and anything else already held)
    trained, itemsize = _trained_weights(model)
    state = training_state(trained, itemsize, world.size, settings.cpu_offload)
    (resident,) = _across_ranks([allocated + held_for_servers], world, dist.ReduceOp.MAX)
    room = LearnerRoom(split, resident=resident, optimizer=state.optimizer)
    refuse_unless_state_fits(room, state)
    switch = checkpointing_switch(model)
    if configured is not None and switch is None:
        return configured
    probes = ModelProbes(model, world, vocab, min(PROBE_SAMPLE_TOKENS, context), packed, allocated, switch)
    plan = plan_learner_passes(room, probes, configured, MODES if switch else None)
    if plan.checkpointing is not None:
        switch.mode = plan.checkpointing.mode
        needs = ", ".join(f"{mode} {gib(needed)}" for mode, needed in plan.checkpointing.needed)
        log.info("learner.activation_checkpointing=auto: %s (a pass of %d tokens needs %s; %s)",
                 plan.checkpointing.mode, plan.checkpointing.tokens, needs, room.describe())
    if configured is None:
        log.info("learner.micro_batch_tokens=auto: %d tokens (a pass of them fits %s)", plan.micro_batch_tokens,
                 room.describe())
    torch.cuda.reset_peak_memory_stats(world.device)  # the probes' peaks are no step's (`peak_memory_metrics`)
    return plan.micro_batch_tokens


class ModelProbes:
    """Passes of random tokens through the model as it will train (`asyncrl.memory_plan.PassProbes`), on every rank
    at once, each measured as the peak memory beyond the weights held before them."""

    def __init__(self, model: torch.nn.Module, world: World, vocab: int, sample: int, packed: bool, resident: float,
                 switch: CheckpointingSwitch | None) -> None:
        self.model, self.world, self.vocab, self.sample, self.packed = model, world, vocab, sample, packed
        self.resident, self.switch = resident, switch

    def line(self, mode: str | None) -> PassMemory:
        """The two probes' line under `mode` on this rank, then the steepest of every rank's (each its own layers and
        shards)."""
        self._switch_to(mode)
        peaks, saved = zip(*[self._probe(tokens) for tokens in PROBE_TOKENS])
        line = pass_memory(PROBE_TOKENS, list(peaks), self.resident, list(saved))
        per_token, fixed = _across_ranks([line.per_token, line.fixed], self.world, dist.ReduceOp.MAX)
        return PassMemory(per_token=per_token, fixed=fixed)

    def needed(self, mode: str | None, tokens: int) -> float:
        self._switch_to(mode)
        peak, _ = self._probe(tokens)
        (needed,) = _across_ranks([peak - self.resident], self.world, dist.ReduceOp.MAX)
        return needed

    def _switch_to(self, mode: str | None) -> None:
        if mode is not None:
            self.switch.mode = mode

    def _probe(self, tokens: int) -> tuple[float, float]:
        """One forward and backward of `tokens` random tokens, gradients dropped after: (peak bytes allocated, bytes
        the forward left allocated for the backward). The second grows with the tokens even where the first does
        not: a large model's peak comes at the end of the backward, when its gradients are complete and a small
        probe's activations are gone (a 3B model peaked equally at 2,048 and 4,096 tokens). A pass that runs out of
        memory needed more than there is: (inf, inf), and the plan tries a cheaper mode or refuses (the 7B shape
        with LoRA ran out in the 4,096-token probe without checkpointing in a 45.5 GiB part)."""
        device = self.world.device
        input_ids, attention_mask = random_rows(tokens, self.sample, self.vocab, device)  # [rows, sample] each
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        peak = saved = math.inf
        try:
            logprobs, _ = target_logprobs(self.model, input_ids, attention_mask, packed=self.packed)  # [rows, sample-1]
            saved = torch.cuda.memory_allocated(device) - before
            logprobs.mean().backward()
            peak = torch.cuda.max_memory_allocated(device)
        except torch.OutOfMemoryError:
            log.info("a probe pass of %d tokens (checkpointing %s) ran out of GPU memory: it does not fit", tokens,
                     self.switch.mode if self.switch else "as the model has it")
        logprobs = None  # the failed pass's tensors go with the frame's last references
        self.model.zero_grad(set_to_none=True)
        if not math.isfinite(peak):
            torch.cuda.empty_cache()  # hand the pass's blocks back before the next probe
        return float(peak), float(saved)


def random_rows(tokens: int, sample: int, vocab: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """About `tokens` random token ids (seeded) as rows of `sample` tokens, and their attention mask (all ones): the
    input of a pass whose cost, not its result, is wanted."""
    rows = max(1, tokens // sample)
    generator = torch.Generator(device="cpu").manual_seed(0)
    input_ids = torch.randint(0, vocab, (rows, sample), generator=generator).to(device)  # [rows, sample]
    return input_ids, torch.ones_like(input_ids)  # [rows, sample] each


def peak_memory_metrics(world: World) -> dict[str, float]:
    """The most GPU memory this learner's allocator held since the last call, allocated and reserved (the largest
    of any rank's), in GiB; then the peaks start again. Nothing on CPU."""
    if world.device.type != "cuda":
        return {}
    peaks = [torch.cuda.max_memory_allocated(world.device), torch.cuda.max_memory_reserved(world.device)]
    torch.cuda.reset_peak_memory_stats(world.device)
    allocated, reserved = _across_ranks([float(peak) for peak in peaks], world, dist.ReduceOp.MAX)
    return {"memory/peak_gib": allocated / BYTES_PER_GIB, "memory/peak_reserved_gib": reserved / BYTES_PER_GIB}


def _trained_weights(model: torch.nn.Module) -> tuple[int, int]:
    """How many weights train (with LoRA the adapters alone), over every rank's shard, and bytes per weight."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return sum(parameter.numel() for parameter in trained), max((p.element_size() for p in trained), default=0)


def _across_ranks(values: list[float], world: World, op: dist.ReduceOp) -> list[float]:
    """`values` reduced element-wise over every rank with `op` (as they are on one rank)."""
    if world.size == 1:
        return values
    packed = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(packed, op=op)
    return packed.tolist()
