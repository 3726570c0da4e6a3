"""Entry point of one learner rank: build model and optimizer, resume, then train while rank 0 serves
the buffer connection, weight sync and metrics."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from asyncrl.config import AsyncRLConfig
from asyncrl.heap import freeze_startup_heap
from asyncrl.logs import setup_logging
from asyncrl.parent_death import die_with_spawning_parent
from asyncrl.placement import servers_share_of_learner_gpu
from asyncrl.stop_signal import interrupt_once
from asyncrl.weight_transfer.backends import weight_backend
from learner.checkpoint import CHECKPOINTS_DIR
from learner.distributed import World, init_world
from learner.guard import RollbackHooks, SafetyGuard
from learner.lagged_weights import LaggedWeights
from learner.logprobs import sampling_temperature
from learner.loop import LoopState, resume_state, run_loop
from learner.memory import resolve_micro_batch_tokens
from learner.policy_model import DTYPES, PinnedWeights, full_weights, full_weights_bytes, load_policy, load_reference
from learner.services import LearnerServices
from learner.task_weight_publisher import TaskWeightsPublisher
from learner.train_step import Passes

log = logging.getLogger(__name__)


def train(config: AsyncRLConfig, run_dir: Path) -> LoopState:
    """Run this rank to learner.total_steps (torchrun-style environment variables give the world)."""
    world = init_world(config.learner.device, cpu_collectives=config.learner.cpu_offload)
    setup_logging(f"learner{world.rank}", config.run.log_level, run_dir / "logs" / f"learner{world.rank}.log")
    if config.learner.torch_threads:
        torch.set_num_threads(config.learner.torch_threads)
    torch.manual_seed(config.run.seed)
    warn_if_updates_round_away(config)
    model = load_policy(config.model.path, config.learner.master_dtype, config.learner, world)
    reference = load_reference(config, world)  # before sizing the micro-batches: its weights take memory too
    passes = plan_passes(config, model, world)  # before the optimizer state exists: auto sizing leaves room for it
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learner.lr, betas=(config.learner.beta1, config.learner.beta2),
        weight_decay=config.learner.weight_decay,
    )
    state = resume_state(config, run_dir, model, optimizer, world)
    pad_id = AutoTokenizer.from_pretrained(config.model.path).pad_token_id or 0
    services = LearnerServices.start(config, run_dir, state.buffer_offset, state.buffer_ahead) if world.is_main else None
    try:
        tasks = None  # rank 0's dynamic task weights, named from the training files before the servers are waited for
        if services is not None and config.data.task_weights.enabled:
            tasks = TaskWeightsPublisher.start(config, state.task_weights, services.coordinator)
        guard = safety_guard(config, run_dir, state.guard)
        share = WeightSharing(config, model, world, services)
        if services is not None:
            services.wait_for_servers()  # the other ranks wait for rank 0 in the weight gather below
        share(state.step)
        if tasks is not None:
            tasks.publish(state.step)
        freeze_startup_heap()  # torch, the model and the services live as long as this rank
        started = time.perf_counter()

        def after_step(version: int, metrics: dict[str, float]) -> None:
            if version % config.learner.sync_every == 0 or version == config.learner.total_steps:
                metrics |= share(version)
            if services is not None:
                services.consumer.publish_version(version)
                if version == config.learner.total_steps:
                    metrics |= services.final_validation(version)
                metrics |= services.consumer.stats().metrics() | services.coordinator.rollout_metrics(version)
                if tasks is not None:  # after validation and rollout metrics: it may watch any of them
                    metrics |= tasks.after_step(version, metrics)
                    state.task_weights = tasks.state_dict()  # the loop's state: its next checkpoint holds them
                if guard is not None:  # last: it may watch any metric, task weights included
                    metrics |= guard.observe(version, metrics)
                metrics["timing_s/elapsed"] = time.perf_counter() - started
                services.metrics.log(version, metrics)
                log.info(progress_line(version, config.learner.total_steps, metrics))

        def after_checkpoint(version: int, buffer_offset: int, buffer_ahead: list[int]) -> None:
            if services is not None:
                services.consumer.commit(version, buffer_offset, buffer_ahead)

        def resume(restored: LoopState) -> None:
            """After a rollback: the restored weights and task weights to the servers as the new version."""
            share(restored.step)
            if services is not None:
                services.consumer.publish_version(restored.step)
            if tasks is not None:
                tasks.restore(restored.task_weights, restored.step)

        state = run_loop(config, run_dir, world, model, optimizer, state,
                         services.fetch_batch if services else None, after_step, after_checkpoint, pad_id, passes, reference,
                         guard, RollbackHooks(services.fetch_batch if services else None, resume))
        if services is not None:
            services.finish(state.step)
    finally:
        if services is not None:
            services.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return state


def safety_guard(config: AsyncRLConfig, run_dir: Path, saved: dict) -> SafetyGuard | None:
    """The guard of `guard.enabled`, continuing from its state in the checkpoint resumed from (`saved`)."""
    if not config.guard.enabled:
        return None
    reach = config.learner.checkpoint_every * config.learner.keep_checkpoints
    return SafetyGuard(config.guard, config.buffer.starting_staleness(), run_dir / CHECKPOINTS_DIR, reach, saved)


def plan_passes(config: AsyncRLConfig, model: torch.nn.Module, world: World) -> Passes:
    """Micro-batch size (measured when auto), packing, and the servers' sampling temperature; every rank calls."""
    packed = config.learner.packs(world.device.type == "cuda")
    tokens = resolve_micro_batch_tokens(model, config.learner, world, model.config.vocab_size,
                                        model.config.max_position_embeddings, packed, servers_share_of_learner_gpu(config))
    log.info("micro-batches of %d tokens, %s", tokens, "packed" if packed else "padded")
    return Passes(micro_batch_tokens=tokens, packed=packed, temperature=sampling_temperature(config.rollout))


def warn_if_updates_round_away(config: AsyncRLConfig) -> None:
    """16-bit master weights keep a step only where it reaches half a unit of the weight's last place."""
    dtype = DTYPES[config.learner.master_dtype]
    if dtype.itemsize >= torch.float32.itemsize:
        return
    resolution = torch.finfo(dtype).eps / 2
    log.warning("learner.master_dtype=%s: an optimizer step smaller than %.1e times a weight is rounded away "
                "(AdamW moves each weight by about learner.lr=%g); float32 keeps every step",
                config.learner.master_dtype, resolution, config.learner.lr)


class WeightSharing:
    """Gathers the full weights (a collective on every rank) in `model.dtype`, the servers' dtype, and
    broadcasts them from rank 0. They are gathered straight onto the learner's GPU when NCCL sends from
    there and they fit in `rollout.weight_sync.staging_bytes`; otherwise into CPU memory, from where the
    coordinator stages what fits before the servers pause. With `buffer.study_lag_versions` = L, rank 0 keeps
    the last L + 1 versions in CPU memory and sends the one L versions back, except the final version, which
    goes out as itself so that its validation (and anything served after the job) sees the trained policy."""

    def __init__(self, config: AsyncRLConfig, model: torch.nn.Module, world: World, services: LearnerServices | None) -> None:
        self.model, self.services = model, services
        self.dtype = DTYPES[config.model.dtype]
        self.final_version = config.learner.total_steps
        lag = config.buffer.study_lag_versions
        self.lagged = LaggedWeights(lag) if lag and services is not None else None
        sync = config.rollout.weight_sync
        sends_from_gpu = world.device.type == "cuda" and weight_backend(sync.backend).device_type == "cuda"
        fits = full_weights_bytes(model, self.dtype) <= sync.staging_bytes
        self.device = world.device if sends_from_gpu and fits and not lag else torch.device("cpu")
        gathers_off_gpu = world.device.type == "cuda" and self.device.type == "cpu"
        # reused page-locked buffers would leave every kept lagged version holding the newest weights
        self.pinned = PinnedWeights() if gathers_off_gpu and services is not None and not lag else None

    def __call__(self, version: int) -> dict[str, float]:
        """Share the weights of `version` (or, lagged, of an older one); rank 0 returns the round's metrics, the
        other ranks {}."""
        if self.services is not None:
            self.services.release_weights()  # the previous round's copy goes before the next is gathered
        started = time.perf_counter()
        weights = full_weights(self.model, self.dtype, self.device, keep=self.services is not None, pinned=self.pinned)
        gathered_s = time.perf_counter() - started
        if self.services is None:
            return {}
        sent = version
        if self.lagged is not None and version < self.final_version:
            sent, weights = self.lagged.lagged(version, weights)
        report = self.services.sync_weights(sent, weights)
        return {
            "weight_sync/version_sent": float(sent),
            "weight_sync/gather_seconds": gathered_s,
            "weight_sync/seconds": report.seconds,
            "weight_sync/transfer_seconds": report.transfer_seconds,
            "weight_sync/server_pause_seconds": report.max_server_pause_s,
            "weight_sync/servers_ok": float(len(report.succeeded)),
            "weight_sync/servers_failed": float(len(report.failed)),
        }


def progress_line(version: int, total: int, metrics: dict[str, float]) -> str:
    """The learner's log line for step `version` of `total`: the headline metrics the step logged."""
    fields = [("reward", "critic/score/mean", ".3f"), ("val", "val/score/mean", ".3f"),
              ("staleness", "staleness/mean", ".3f"), ("K", "staleness/max_staleness", "d"), ("pg_loss", "actor/pg_loss", ".3f"),
              ("gen_tok/s", "rollout/tokens_per_s", ".0f"), ("train_tok/s", "learner/tokens_per_s", ".0f"),
              ("sync_s", "weight_sync/seconds", ".3f"), ("wait_s", "timing_s/wait_batch", ".3f"),
              ("step_s", "timing_s/step", ".3f")]
    shown = [f"{label} {metrics[key]:{spec}}" for label, key, spec in fields if key in metrics]
    return " ".join([f"step {version}/{total}", *shown])


def spawned_rank(rank: int, size: int, port: int, config: AsyncRLConfig, run_dir: str) -> None:
    """Target of the local spawner: set the torchrun-style variables, then train. SIGTERM is taken like Ctrl-C
    (once), so that a stopped rank unwinds through `train`'s cleanup (torch's spawn wrapper ends it quietly)."""
    die_with_spawning_parent()  # `asyncrl learner` killed outright takes its ranks (and their buffer) along
    interrupt_once()  # the group's signal and the one `asyncrl learner` forwards: the second must not cut the cleanup
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        train(config, Path(run_dir))
    except Exception as error:  # its reason and traceback into the rank's log (the console gets one line)
        log.exception("learner rank %d failed: %s: %s", rank, type(error).__name__, error)
        raise
