"""`learner.mode=synchronous`: synchronous RL, written out plainly. One process owns a vLLM engine and the policy:

    validate the first weights when due                        (Sampler.validate)
    for each step:
        generate a batch with the current weights, score it    (Sampler.sample)
        train one optimizer step on it                         (Trainer.train)
        load the new weights into the engine                   (Sampler.load_weights)
        validate them when due                                 (Sampler.validate)

With `learner.nproc` = N it runs colocated on N GPUs, as verl's hybrid engine does: N such processes, one per GPU,
each with its engine and one FSDP2 rank of the policy. Each samples its share of the step's prompts, the shares are
pooled (`Trainer.gathered`) into the batch one process would have sampled, every rank trains on it, and each loads
the full new weights into its own engine. A validation pass is split among the ranks the same way; rank 0 records.

With `validation.after_run` the passes do not run here: the weights of each due version are kept instead
(`learner.services.snapshots`), as the async learner keeps them, and `asyncrl evaluate` scores both jobs' the same way.

It runs the async job's own generation and training code (engine, sampling, rewards, collate, advantages,
losses, learning-rate schedule, optimizer step) without its plumbing: no buffer, no admission, no weight-sync
coordinator, no staleness bound (docs/architecture.md lists what is shared). It is the
reference the async job with `buffer.max_staleness=0` must reproduce step by step
(tests/integration/test_k0_matches_reference.py: the plumbing changes nothing at K = 0; the shared RL maths is
checked on its own by tests/unit/learner/test_independent_grpo.py) and the baseline of
scripts/bench_async_vs_sync.py and scripts/bench_time_to_score.py. Each step's metrics go to `metrics.jsonl` under
the names the async learner uses, a validation pass's `val/*` in the record of the step that made the version it
validated (version 0's in a record of step 0); its timings leave the pass out, its `val/seconds` says how long it
took. The groups each step trained on go to `trained/step_N.msgpack` (`trained_groups` reads them).

The two halves live in their roles (rollout_servers/reference_sampler.py, learner/reference_trainer.py); the
`asyncrl learner` command builds them and hands them in."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from asyncrl.config import AsyncRLConfig
from asyncrl.messages import TrajectoryGroup, decode, encode
from asyncrl.metrics import MetricsLogger
from learner.bad_steps import note_bad_step
from learner.maths.step_metrics import batch_metrics
from learner.services.snapshots import SnapshotWriter

log = logging.getLogger(__name__)

TRAINED_DIR = "trained"  # under the run directory: step_N.msgpack, the groups step N trained on
_FRAME_LENGTH_BYTES = 8  # each group's message is preceded by its length (little-endian)


class Sampler(Protocol):
    weights_device: Any  # the torch.device `load_weights` sends from

    def sample(self) -> list[TrajectoryGroup]: ...

    def load_weights(self, version: int, weights: Sequence[tuple[str, Any]]) -> float: ...

    def validate(self, gathered: Callable[[bytes], list[bytes]]) -> dict[str, float]: ...


class TrainedStep(Protocol):
    metrics: dict[str, float]  # actor/* of the step
    finite: bool  # False: the loss was not finite and the update was skipped


class Trainer(Protocol):
    is_main: bool  # rank 0 (the only one of a one-rank run): records

    def gathered(self, payload: bytes) -> list[bytes]: ...  # every rank's payload, in rank order

    def train(self, groups: list[TrajectoryGroup], version: int) -> TrainedStep: ...

    def weights(self, device: Any) -> Sequence[tuple[str, Any]]: ...


def run(config: AsyncRLConfig, run_dir: Path, sampler: Sampler, trainer: Trainer, metrics: MetricsLogger | None,
        snapshots: SnapshotWriter | None = None) -> int:
    """Train to `learner.total_steps`; returns the final policy version. `metrics` and `snapshots` are rank 0's (None
    on the others). With `validation.after_run` the weights of each version due for validation are kept (`snapshots`)
    as the async learner keeps them."""
    version, bad_steps, main = 0, 0, trainer.is_main
    if config.validation.after_run:  # gathering the weights is a collective: every rank takes part
        weights = trainer.weights(sampler.weights_device)
        if snapshots is not None:
            snapshots.keep(version, weights)
        del weights
    if (first := sampler.validate(trainer.gathered)) and main:  # every rank: a pass is split among them
        metrics.log(version, first)
    started = time.perf_counter()
    while version < config.learner.total_steps:
        step_started = time.perf_counter()
        groups, sampled = pooled_batch(sampler.sample(), trainer)
        generated = time.perf_counter()
        outcome = trainer.train(groups, version)
        trained = time.perf_counter()
        if not outcome.finite:  # the step was skipped: the engine keeps its weights, the next batch comes
            bad_steps += 1
            note_bad_step(bad_steps, version + 1, config.learner.max_bad_steps)
            continue
        bad_steps, version = 0, version + 1
        weights = trainer.weights(sampler.weights_device)
        if snapshots is not None:
            snapshots.keep(version, weights)
        paused_s = sampler.load_weights(version, weights)
        del weights  # the engine holds the version now; this copy must not outlive the step
        synced = time.perf_counter()
        validation = sampler.validate(trainer.gathered)  # every rank: a pass is split among them
        if not main:
            continue
        write_trained(run_dir, version, sampled)
        record = outcome.metrics | batch_metrics(groups, version - 1) | {
            "timing_s/wait_batch": generated - step_started,  # what the policy waits for: the whole generation
            "timing_s/train": trained - generated,
            "weight_sync/seconds": synced - trained,
            "weight_sync/server_pause_seconds": paused_s,
            "timing_s/step": synced - step_started,
            "timing_s/elapsed": synced - started,
        }
        record["rollout/tokens_per_s"] = record["batch/tokens"] / record["timing_s/wait_batch"]
        record["learner/tokens_per_s"] = record["batch/tokens"] / record["timing_s/train"]
        metrics.log(version, record | validation)
        log.info("step %d/%d reward %.3f pg_loss %.3f step_s %.3f", version, config.learner.total_steps,
                 record["critic/score/mean"], record["actor/pg_loss"], record["timing_s/step"])
    return version


def pooled_batch(mine: list[TrajectoryGroup], trainer: Trainer) -> tuple[list[TrajectoryGroup], bytes]:
    """The step's batch from this rank's share `mine`: every rank's groups in rank order, and their `frames` (what
    the step keeps). A one-rank run's share is the batch: it is not decoded back from its own bytes."""
    shares = trainer.gathered(frames(mine))
    if len(shares) == 1:
        return mine, shares[0]
    pooled = b"".join(shares)
    return unframed(pooled), pooled


def frames(groups: list[TrajectoryGroup]) -> bytes:
    """`groups` in the wire format, each message preceded by its length: frames joined stay frames (packed
    per-token arrays: cheap for long batches)."""
    return b"".join(len(frame).to_bytes(_FRAME_LENGTH_BYTES, "little") + frame for frame in map(encode, groups))


def unframed(data: bytes) -> list[TrajectoryGroup]:
    """The groups of `frames`' bytes, in order."""
    groups, at = [], 0
    while at < len(data):
        length = int.from_bytes(data[at:at + _FRAME_LENGTH_BYTES], "little")
        at += _FRAME_LENGTH_BYTES
        groups.append(decode(data[at:at + length], expect=TrajectoryGroup))
        at += length
    return groups


def write_trained(run_dir: Path, step: int, sampled: bytes) -> None:
    """Keep the groups `step` trained on (`frames` of them)."""
    path = run_dir / TRAINED_DIR / f"step_{step}.msgpack"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(sampled)


def trained_groups(run_dir: Path, step: int) -> list[TrajectoryGroup]:
    """The groups `step` of the reference run in `run_dir` trained on, in the order it sampled them."""
    return unframed((run_dir / TRAINED_DIR / f"step_{step}.msgpack").read_bytes())
