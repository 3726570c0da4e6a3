"""One learner step on a batch: advantages and anchor log-probs once, then `algorithm.mini_batches` ×
`algorithm.epochs` optimizer steps, each a micro-batched loss and backward over one mini-batch (whole groups),
gradient clipping and an update. However many steps it takes, the batch makes one policy version: π_prox, the
policy that started the batch, anchors every step, while π_θ moves from step to step. Every rank holds the whole
batch and trains on its share of each mini-batch's rows; losses are normalised by whole-mini-batch counts so that
any number of ranks computes the same gradient."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from asyncrl.config.algorithm import AlgorithmConfig
from learner.distributed import World, gather_varying, sum_across_ranks
from learner.maths.advantages import compute_advantages
from learner.maths.batching import TrainBatch, micro_batches
from learner.maths.logprobs import target_logprobs
from learner.maths.loss_terms import SEQ_MEAN_TOKEN_SUM_NORM, TOKEN_MEAN, second_moment_cutoff
from learner.maths.losses import LossInputs, compute_policy_loss, second_moment_summary
from learner.maths.mini_batches import mini_batch_rows
from learner.policy.lora import adapter_dropout, has_adapter_dropout
from learner.policy.memory import out_of_memory_names_keys

NEEDS_PROXIMAL = ("decoupled_ppo", "seq_mask", "m2po", "decoupled_ppo_kl")  # losses that read π_prox, the batch's starting policy
NEEDS_SECOND_MOMENT_CUTOFF = ("m2po",)  # losses whose mask needs a statistic of the whole optimizer step's tokens


@dataclass(frozen=True)
class Passes:
    """How a step's rows go through the model."""

    micro_batch_tokens: int  # tokens per forward/backward pass (packed: real tokens; padded: rows x longest row)
    packed: bool = False  # each micro-batch's samples back to back in one sequence (learner.packing)
    temperature: float = 1.0  # divides the logits (learner.maths.logprobs.sampling_temperature)


@dataclass
class StepOutcome:
    metrics: dict[str, float]  # averaged over micro-batches and ranks, then over the batch's optimizer steps
    finite: bool  # False: a loss or gradient was NaN/inf; that update and the batch's later ones were skipped


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
    `reference` is the frozen model of `algorithm.use_reference` (with LoRA and no `algorithm.reference_path`, the
    policy with its adapters off, `learner.policy.lora.AdaptersOff`). Every optimizer step runs at the learning rate
    the caller set for the batch."""
    batch = batch.to(world.device)
    advantages = compute_advantages(batch.rewards, batch.group_index, batch.loss_mask, algorithm)  # [B, T-1]
    minis = _plan(batch, advantages, algorithm, passes, world)
    from_training = proximal_from_training_pass(model, algorithm)
    scoring = model if proximal_pass_up_front(model, algorithm) else None
    with out_of_memory_names_keys(passes.micro_batch_tokens):
        _score_anchors(scoring, reference, minis, algorithm, passes, world, from_training)
    updates = []
    for mini in [mini for _ in range(algorithm.epochs) for mini in minis]:
        metrics, finite = _optimizer_step(model, optimizer, mini, algorithm, passes, grad_clip, world)
        updates.append(metrics)
        if not finite:
            # the weights already moved by the batch's earlier steps stay; the caller counts a bad step
            return StepOutcome(metrics=_over_updates(updates), finite=False)
    return StepOutcome(metrics=_over_updates(updates), finite=True)


def proximal_from_training_pass(model: torch.nn.Module, algorithm: AlgorithmConfig) -> bool:
    """Whether π_prox comes from the training passes themselves, with no pass up front: with one optimizer step per
    batch (`algorithm.mini_batches` × `algorithm.epochs` = 1) the weights a training pass runs are the batch's
    starting ones, so its log-probs, detached, are π_prox's, and the pass up front (a quarter of a step's model FLOPs)
    would only repeat them. Not where a loss needs π_prox over the whole mini-batch before its first pass (m2po's
    cutoff), nor where adapter dropout makes a training pass differ from the policy that scores."""
    return (algorithm.loss in NEEDS_PROXIMAL and algorithm.mini_batches * algorithm.epochs == 1
            and algorithm.loss not in NEEDS_SECOND_MOMENT_CUTOFF and not has_adapter_dropout(model))


def proximal_pass_up_front(model: torch.nn.Module, algorithm: AlgorithmConfig) -> bool:
    """Whether a step scores π_prox in a no-grad pass before its first update: the loss reads π_prox and the
    training passes cannot give it (`proximal_from_training_pass`)."""
    return algorithm.loss in NEEDS_PROXIMAL and not proximal_from_training_pass(model, algorithm)


def _optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, mini: "MiniBatch", algorithm: AlgorithmConfig,
    passes: Passes, grad_clip: float, world: World,
) -> tuple[dict[str, float], bool]:
    """One update on one mini-batch: its metrics, and whether they were finite (else the update is skipped)."""
    optimizer.zero_grad(set_to_none=True)
    with out_of_memory_names_keys(passes.micro_batch_tokens), adapter_dropout(model):
        per_chunk = _train_passes(model, mini, algorithm, world, passes)
    grad_norm = _clip(model, grad_clip)
    metrics = _combine(per_chunk, world) | mini.step_metrics | {"actor/grad_norm": grad_norm}
    # Judged on whole-mini-batch numbers that every rank holds alike, so all ranks skip or step together. The
    # check sits before the update rather than before backward: FSDP's backward is a collective every
    # rank must join, and a NaN gradient is harmless once it is discarded here.
    finite = _is_finite(metrics)
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return metrics, finite


@dataclass
class Pass:
    """One forward/backward pass's metrics."""

    metrics: dict[str, float]  # what the loss reported for one micro-batch
    real: bool  # False: a padding pass, whose metrics name the keys but add no value


def _train_passes(
    model: torch.nn.Module, mini: "MiniBatch", algorithm: AlgorithmConfig, world: World, passes: Passes,
) -> list[Pass]:
    """Forward and backward of each micro-batch, gradients accumulating; the metrics of each pass."""
    assert mini.anchors is not None
    per_chunk = []
    for index, chunk in enumerate(mini.chunks):
        part = mini.part.select(chunk.rows)
        logprobs, entropy = target_logprobs(model, part.input_ids, part.attention_mask, passes.temperature,
                                            packed=passes.packed, wanted=part.loss_mask)  # [b, T-1] each
        inputs = LossInputs(
            logprobs=logprobs,
            behaviour_logprobs=part.behaviour_logprobs,
            advantages=mini.advantages[chunk.rows, : part.target_width],
            loss_mask=part.loss_mask,
            proximal_logprobs=mini.anchors.proximal_of(index, logprobs),
            reference_logprobs=None if mini.anchors.reference is None else mini.anchors.reference[index],
            entropy=entropy,
            denominator=mini.denominator,
            m2_cutoff=mini.m2_cutoff,
        )
        loss, metrics = compute_policy_loss(inputs, algorithm)
        # FSDP averages gradients over ranks; scaling by the world size turns that average into the sum
        # of every rank's share of the whole-batch loss. A padding chunk contributes a zero gradient.
        scale = 0.0 if chunk.padding else float(world.size)
        (loss * scale).backward()
        per_chunk.append(Pass(metrics, real=not chunk.padding))
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


@dataclass
class MiniBatch:
    """The rows of one optimizer step, with what is fixed for them before the batch's first update."""

    part: TrainBatch  # the rows, cut to the longest of them
    advantages: Tensor  # [b, T'-1] computed over the whole batch
    chunks: list[Chunk]  # this rank's micro-batches of the rows
    denominator: float  # tokens or sequences of the mini-batch: its loss is a mean over them
    anchors: Anchors | None = None  # log-probs under the batch's starting weights and the reference
    m2_cutoff: float | None = None  # m2po's cutoff over the mini-batch's tokens on every rank
    step_metrics: dict[str, float] = field(default_factory=dict)  # taken over the whole mini-batch, replacing per-pass means


def _plan(batch: TrainBatch, advantages: Tensor, algorithm: AlgorithmConfig, passes: Passes, world: World) -> list[MiniBatch]:
    """The batch's mini-batches (whole groups, algorithm.mini_batches) and this rank's micro-batches of each."""
    minis = []
    for rows in mini_batch_rows(batch.group_index, algorithm.mini_batches):
        part = batch.select(rows)
        chunks = rank_chunks(part, passes.micro_batch_tokens, world, passes.packed)
        minis.append(MiniBatch(part, advantages[rows, : part.target_width], chunks, _denominator(part, algorithm)))
    return minis


def _score_anchors(policy: torch.nn.Module | None, reference: torch.nn.Module | None, minis: list[MiniBatch],
                 algorithm: AlgorithmConfig, passes: Passes, world: World, from_training: bool) -> None:
    """Score every mini-batch before the first update: π_prox stays the policy that started the batch (`policy`
    None: π_prox from the training passes where `from_training`, else none needed)."""
    for mini in minis:
        mini.anchors = _anchor_logprobs(policy, reference, mini.part, mini.chunks, passes, from_training)
        if algorithm.loss in NEEDS_SECOND_MOMENT_CUTOFF:
            squared = _squared_log_ratios(mini, world)  # [N]
            mini.m2_cutoff = second_moment_cutoff(squared, algorithm.m2_threshold)
            mini.step_metrics = second_moment_summary(squared, mini.m2_cutoff)


def _squared_log_ratios(mini: MiniBatch, world: World) -> Tensor:
    """[N] (log π_prox − log π_behav)² of every trained token of the mini-batch, on every rank's rows."""
    assert mini.anchors is not None and mini.anchors.proximal is not None
    squared = []
    for chunk, proximal in zip(mini.chunks, mini.anchors.proximal):
        if not chunk.padding:
            part = mini.part.select(chunk.rows)
            squared.append((proximal - part.behaviour_logprobs).square()[part.loss_mask.bool()])  # [n]
    # float64 on every rank, so that a rank without rows gathers alike with one holding float32 log-probs
    mine = torch.cat(squared).double() if squared else torch.zeros(0, dtype=torch.float64, device=world.device)
    return torch.cat(gather_varying(mine, world))


def _denominator(batch: TrainBatch, algorithm: AlgorithmConfig) -> float:
    """The whole batch's count that `learner.maths.loss_terms.aggregate` divides by: trained tokens (token_mean),
    sequences with at least one trained token (seq_mean_token_sum), or those sequences × `algorithm.norm_tokens`
    (seq_mean_token_sum_norm, its 0 resolved by `AlgorithmConfig.resolved`)."""
    trained = batch.loss_mask.bool()  # [B, T-1]
    if algorithm.aggregation == TOKEN_MEAN:
        return float(trained.sum().clamp(min=1))
    sequences = float(trained.any(dim=1).sum().clamp(min=1))
    if algorithm.aggregation == SEQ_MEAN_TOKEN_SUM_NORM:
        if algorithm.norm_tokens < 1:
            raise ValueError("algorithm.norm_tokens is 0 here: resolve it (AlgorithmConfig.resolved) before training")
        return sequences * algorithm.norm_tokens
    return sequences


@dataclass
class Anchors:
    """Log-probs fixed before the update, per chunk, [b, T-1] each (None where the step needs none)."""

    proximal: list[torch.Tensor] | None  # log π_prox: the policy's weights before the batch's first update
    reference: list[torch.Tensor] | None  # log π_ref: the frozen reference model
    proximal_from_training: bool = False  # π_prox is each training pass's own log-probs (proximal_from_training_pass)

    def proximal_of(self, index: int, training_logprobs: Tensor) -> Tensor | None:
        """[b, T-1] log π_prox of chunk `index`, whose training pass gave `training_logprobs` (None: none needed)."""
        if self.proximal_from_training:
            return training_logprobs.detach()
        return None if self.proximal is None else self.proximal[index]


@torch.no_grad()
def _anchor_logprobs(policy: torch.nn.Module | None, reference: torch.nn.Module | None, batch: TrainBatch,
                     chunks: list[Chunk], passes: Passes, proximal_from_training: bool) -> Anchors:
    """One pass over the chunks up front scoring them under the pre-update policy and the reference."""
    proximal: list[torch.Tensor] | None = [] if policy is not None else None
    referenced: list[torch.Tensor] | None = [] if reference is not None else None
    for chunk in chunks:
        part = batch.select(chunk.rows)
        for model, into in ((policy, proximal), (reference, referenced)):
            if model is not None:
                into.append(target_logprobs(model, part.input_ids, part.attention_mask, passes.temperature,
                                            with_entropy=False, packed=passes.packed, wanted=part.loss_mask)[0])
    return Anchors(proximal=proximal, reference=referenced, proximal_from_training=proximal_from_training)


def _clip(model: torch.nn.Module, grad_clip: float) -> float:
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


ADDITIVE_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/behaviour_kl_loss")  # partial sums of the whole-batch loss: add up
LOSS_AND_GRADIENT = (*ADDITIVE_METRICS, "actor/grad_norm")  # NaN/inf in any of these skips the update


def _is_finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(metrics[key]) for key in LOSS_AND_GRADIENT if key in metrics)


def _combine(records: list[Pass], world: World) -> dict[str, float]:
    """One optimizer step's metrics: loss parts summed over real passes and ranks, the rest averaged over real
    passes. Every rank runs at least one pass, padding or not, so every rank sums the same keys (a rank holding
    none of a small mini-batch's rows included)."""
    keys = sorted({k for record in records for k in record.metrics})
    real = [record.metrics for record in records if record.real]
    totals = {k: sum(r.get(k, 0.0) for r in real) for k in keys} | {"_passes": float(len(real))}
    totals = sum_across_ranks(totals, world)
    passes = max(totals.pop("_passes"), 1.0)
    return {k: v if k in ADDITIVE_METRICS else v / passes for k, v in totals.items()}


def _over_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """The batch's metrics: one optimizer step's as they are; several steps' averaged, with the step count and
    the first and last step's `actor/pg_clipfrac` (the first step's π_θ is π_prox, so a clip anchored there
    binds only in later steps)."""
    if len(updates) == 1:
        return updates[0]
    keys = sorted({key for update in updates for key in update})
    metrics = {key: math.fsum(u[key] for u in updates if key in u) / sum(key in u for u in updates) for key in keys}
    metrics["actor/optimizer_steps"] = float(len(updates))
    if "actor/pg_clipfrac" in updates[0]:
        metrics["actor/pg_clipfrac_first_step"] = updates[0]["actor/pg_clipfrac"]
    if "actor/pg_clipfrac" in updates[-1]:
        metrics["actor/pg_clipfrac_last_step"] = updates[-1]["actor/pg_clipfrac"]
    return metrics
