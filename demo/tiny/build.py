"""Build, warm-start and save the tiny default model; cached by a hash of everything that shapes it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from asyncrl.config import AsyncRLConfig
from asyncrl.config.sections import WarmStartConfig
from asyncrl.thinking import Thinking
from demo.tasks.catalog import SingleTurn, task_kind
from demo.tiny.model import build_tiny_model
from demo.tiny.report import REPORT_FILE, read_report
from demo.tiny.vocabulary import build_tokenizer
from demo.tiny.warm_start import AnswerScorer, greedy_accuracy, warm_start

log = logging.getLogger(__name__)

# The tiny model's matrices are too small to split among many threads: on a 64-core GPU host the warm start took
# 312 s with torch's default of one thread per core and 29 s with 8 (57 s on a 2-core box).
WARM_START_THREADS = 8
# cuBLAS's workspace setting under which its results do not depend on what ran before on the stream (NVIDIA's
# "results reproducibility"); read when a process first uses cuBLAS.
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"
# Settings that leave the weights as they are (up to the bits of a GPU's reductions), so left out of the cache key:
# models built before they existed keep their keys.
NOT_SHAPING = ("micro_batches", "deterministic")


def init_model(config: AsyncRLConfig, scorer_for: Callable[[str], AnswerScorer], force: bool = False) -> dict[str, Any]:
    """Make sure a warm-started tiny model for `config` exists at `config.model.path`; return its report.
    `scorer_for` gives the scorer of a data source (the rollout servers' built-in scorers, handed in by the caller),
    with which the greedy accuracy before and after the warm start is measured."""
    target = Path(config.model.path)
    tokenizer = build_tokenizer(config.model.tiny.tokenizer)
    thinking = Thinking.for_tokenizer(config.rollout.thinking, tokenizer)  # prompts rendered as RL will render them
    key = cache_key(config, tokenizer, thinking)
    cached = read_report(target)
    if not force and cached.get("cache_key") == key:
        log.info("tiny model at %s is up to date (cache key %s)", target, key[:12])
        return cached
    started = time.perf_counter()
    model = build_tiny_model(config.model.tiny, tokenizer, config.run.seed).to(_device(config.model.warm_start.device))
    kind = task_kind(config.task)
    split = kind.split(config.task, config.run.seed)
    held_out = split.val[: config.model.warm_start.eval_samples]  # the validation file's first problems

    def accuracy() -> float | None:
        """Single-turn greedy accuracy only: a multi-turn task's starting reward is validation's version 0. None
        without held-out problems to decode (a ~600 M model's pass of the longest answers took 55 s on an H200)."""
        if not isinstance(kind.teacher, SingleTurn) or not held_out:
            return None
        return greedy_accuracy(model, tokenizer, held_out, kind.teacher, scorer_for(kind.teacher.data_source), thinking)

    deterministic = config.model.warm_start.deterministic and model.device.type == "cuda"
    with at_most_threads(WARM_START_THREADS):
        before = accuracy()
        with deterministic_kernels(deterministic):  # the weights only: the greedy passes' ops need not have one
            warm_start(model, tokenizer, config.task, config.model.warm_start, config.run.seed, split.val_questions,
                       thinking)
        after = accuracy()
    report = {
        "cache_key": key,
        "parameters": sum(p.numel() for p in model.parameters()),
        "accuracy_before_warm_start": before,
        "accuracy_after_warm_start": after,
        "warm_start_steps": config.model.warm_start.steps,
        "weights_sha256": weights_digest(model),
        "seconds": round(time.perf_counter() - started, 1),
    }
    _save(model, tokenizer, target, report)
    log.info("saved tiny model to %s: greedy accuracy %s -> %s", target, before, after)
    return report


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's tensors in name order (each name, dtype and shape, then its bytes): two builds made the
    same weights exactly when their digests agree, such as a race's two modes prepared on different hosts."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


@contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """Where `enabled`, inside the block: torch's deterministic algorithms, strictly (an op without one raises, naming
    itself; in warn-only mode the flash and memory-efficient attention backwards keep their faster, order-varying
    accumulation), and cuBLAS's deterministic workspace unless the process set its own (read at its first cuBLAS call,
    so before it). A 600 M-parameter warm start on an H100 hit no op without a deterministic algorithm."""
    if not enabled:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    was_on = torch.are_deterministic_algorithms_enabled()
    warned_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=warned_only)


@contextmanager
def at_most_threads(limit: int) -> Iterator[None]:
    """torch's intra-op threads capped at `limit` inside the block (fewer cores: as many as there are)."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, limit))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.warm_start.device=cuda, but torch sees no GPU here: use cpu")
    return torch.device(name)


def cache_key(config: AsyncRLConfig, tokenizer: Any, thinking: Thinking) -> str:
    """Hash of every setting that changes the saved model, `tokenizer`'s vocabulary and merges among them."""
    shaping = {
        "tiny": dataclasses.asdict(config.model.tiny),
        "warm_start": _shaping_fields(config.model.warm_start),
        "task": dataclasses.asdict(config.task) | {"out_dir": None, "format": None, "num_train": None},
        "seed": config.run.seed,
        "tokenizer": hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest(),
        "torch": torch.__version__,
    }
    # the template options change the warm start's prompts; left out when there are none, so that models built
    # before `rollout.thinking` existed keep their keys
    if options := thinking.template_options():
        shaping["template_options"] = options
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()


def _shaping_fields(schedule: WarmStartConfig) -> dict[str, Any]:
    """The warm start's settings but NOT_SHAPING: how a step's passes are cut leaves its gradient as it is
    (`accumulate_gradient`), and deterministic kernels change no more than the last bits of a GPU's sums."""
    return {name: value for name, value in dataclasses.asdict(schedule).items() if name not in NOT_SHAPING}


def _save(model: torch.nn.Module, tokenizer: Any, target: Path, report: dict[str, Any]) -> None:
    """Write to a sibling temp dir, then rename: a killed init never leaves a half-written model."""
    staging = target.with_name(target.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2))
    if target.exists():
        backup = target.with_name(target.name + ".old")
        target.rename(backup)
        staging.rename(target)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        staging.rename(target)
