"""One optimizer step on a batch: advantages, proximal log-probs, micro-batched loss and backward,
gradient clipping, update. Every rank holds the whole batch and trains on its share of the rows;
losses are normalised by whole-batch counts so that any number of ranks computes the same gradient."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncrl.config.algorithm import AlgorithmConfig
from learner.advantages import compute_advantages
from learner.batching import TrainBatch, micro_batches
from learner.distributed import World, sum_across_ranks
from learner.logprobs import target_logprobs
from learner.losses import LossInputs, compute_policy_loss
from learner.memory import out_of_memory_names_keys

NEEDS_PROXIMAL = ("decoupled_ppo", "seq_mask")  # losses that anchor the clip on the learner's pre-update policy


@dataclass(frozen=True)
class Passes:
    """How a step's rows go through the model."""

    micro_batch_tokens: int  # tokens per forward/backward pass (packed: real tokens; padded: rows x longest row)
    packed: bool = False  # each micro-batch's samples back to back in one sequence (learner.packing)
    temperature: float = 1.0  # divides the logits (learner.logprobs.sampling_temperature)


@dataclass
class StepOutcome:
    metrics: dict[str, float]  # averaged over micro-batches and ranks
    finite: bool  # False: the loss or gradient was NaN/inf and the update was skipped


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    algorithm: AlgorithmConfig,
    passes: Passes,
    grad_clip: float,
    world: World,
    reference: torch.nn.Module | None = None,
) -> StepOutcome:
    """`passes.temperature` makes π the distribution the rollout servers' behaviour log-probs were taken from;
    `reference` is the frozen model of `algorithm.use_reference`."""
    batch = batch.to(world.device)
    advantages = compute_advantages(batch.rewards, batch.group_index, batch.loss_mask, algorithm)  # [B, T-1]
    chunks = rank_chunks(batch, passes.micro_batch_tokens, world, passes.packed)
    denominator = _denominator(batch, algorithm)
    with out_of_memory_names_keys(passes.micro_batch_tokens):
        anchors = _anchor_logprobs(model if algorithm.loss in NEEDS_PROXIMAL else None, reference, batch, chunks, passes)
        optimizer.zero_grad(set_to_none=True)
        per_chunk = _train_passes(model, batch, chunks, advantages, anchors, denominator, algorithm, world, passes)
    grad_norm = _clip(model, grad_clip)
    metrics = _combine(per_chunk, world) | {"actor/grad_norm": grad_norm}
    # Judged on whole-batch numbers that every rank holds alike, so all ranks skip or step together. The
    # check sits before the update rather than before backward: FSDP's backward is a collective every
    # rank must join, and a NaN gradient is harmless once it is discarded here.
    finite = _is_finite(metrics)
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return StepOutcome(metrics=metrics, finite=finite)


def _train_passes(
    model: torch.nn.Module, batch: TrainBatch, chunks: list["Chunk"], advantages: torch.Tensor,
    anchors: "Anchors", denominator: float, algorithm: AlgorithmConfig, world: World, passes: Passes,
) -> list[dict[str, float]]:
    """Forward and backward of each micro-batch, gradients accumulating; the metrics of each real pass."""
    per_chunk = []
    for index, chunk in enumerate(chunks):
        part = batch.select(chunk.rows)
        logprobs, entropy = target_logprobs(model, part.input_ids, part.attention_mask, passes.temperature,
                                            packed=passes.packed)  # [b, T-1] each
        inputs = LossInputs(
            logprobs=logprobs,
            behaviour_logprobs=part.behaviour_logprobs,
            advantages=advantages[chunk.rows, : part.target_width],
            loss_mask=part.loss_mask,
            proximal_logprobs=None if anchors.proximal is None else anchors.proximal[index],
            reference_logprobs=None if anchors.reference is None else anchors.reference[index],
            entropy=entropy,
            denominator=denominator,
        )
        loss, metrics = compute_policy_loss(inputs, algorithm)
        # FSDP averages gradients over ranks; scaling by the world size turns that average into the sum
        # of every rank's share of the whole-batch loss. A padding chunk contributes a zero gradient.
        scale = 0.0 if chunk.padding else float(world.size)
        (loss * scale).backward()
        if not chunk.padding:
            per_chunk.append(metrics)
    return per_chunk


@dataclass
class Chunk:
    rows: list[int]  # batch rows of one forward/backward pass
    padding: bool = False  # a stand-in pass so that every rank runs as many passes as the busiest one


def rank_chunks(batch: TrainBatch, micro_batch_tokens: int, world: World, packed: bool = False) -> list[Chunk]:
    """This rank's micro-batches: rows rank, rank + size, ... cut by the token budget. FSDP gathers
    parameters collectively, so every rank runs the same number of passes; shorter lists are padded."""
    counts = []
    mine: list[Chunk] = []
    for rank in range(world.size):
        share = list(range(rank, len(batch), world.size))
        chunks = [Chunk([share[i] for i in rows]) for rows in micro_batches(batch.select(share), micro_batch_tokens, packed)] if share else []
        counts.append(len(chunks))
        if rank == world.rank:
            mine = chunks
    return mine + [Chunk([0], padding=True)] * (max(counts) - len(mine))


def _denominator(batch: TrainBatch, algorithm: AlgorithmConfig) -> float:
    """The whole batch's count that `learner.loss_terms.aggregate` divides by: trained tokens (token_mean), or
    sequences with at least one trained token (seq_mean_token_sum)."""
    trained = batch.loss_mask.bool()  # [B, T-1]
    if algorithm.aggregation == "token_mean":
        return float(trained.sum().clamp(min=1))
    return float(trained.any(dim=1).sum().clamp(min=1))


@dataclass
class Anchors:
    """Log-probs fixed before the update, per chunk, [b, T-1] each (None where the step needs none)."""

    proximal: list[torch.Tensor] | None  # log π_prox: the policy's weights before this update
    reference: list[torch.Tensor] | None  # log π_ref: the frozen reference model


@torch.no_grad()
def _anchor_logprobs(policy: torch.nn.Module | None, reference: torch.nn.Module | None, batch: TrainBatch,
                     chunks: list[Chunk], passes: Passes) -> Anchors:
    """One pass over the chunks up front scoring them under the pre-update policy and the reference."""
    proximal: list[torch.Tensor] | None = [] if policy is not None else None
    referenced: list[torch.Tensor] | None = [] if reference is not None else None
    for chunk in chunks:
        part = batch.select(chunk.rows)
        for model, into in ((policy, proximal), (reference, referenced)):
            if model is not None:
                into.append(target_logprobs(model, part.input_ids, part.attention_mask, passes.temperature,
                                            with_entropy=False, packed=passes.packed)[0])
    return Anchors(proximal=proximal, reference=referenced)


def _clip(model: torch.nn.Module, grad_clip: float) -> float:
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


ADDITIVE_METRICS = ("actor/pg_loss", "actor/kl_loss")  # partial sums of the whole-batch loss: add up
LOSS_AND_GRADIENT = (*ADDITIVE_METRICS, "actor/grad_norm")  # NaN/inf in any of these skips the update


def _is_finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(metrics[key]) for key in LOSS_AND_GRADIENT if key in metrics)


def _combine(records: list[dict[str, float]], world: World) -> dict[str, float]:
    """Whole-batch metrics: loss parts summed over passes and ranks, the rest averaged over passes."""
    keys = sorted({k for record in records for k in record})
    totals = {k: sum(r.get(k, 0.0) for r in records) for k in keys} | {"_passes": float(len(records))}
    totals = sum_across_ranks(totals, world)
    passes = max(totals.pop("_passes"), 1.0)
    return {k: v if k in ADDITIVE_METRICS else v / passes for k, v in totals.items()}

