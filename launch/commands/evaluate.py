"""`asyncrl evaluate RUN_DIR...`: score the weight snapshots of jobs run with `validation.after_run` (asyncrl/snapshots.py)
on their held-out prompts, after the jobs, on one vLLM engine of this command's own.

Each run's snapshots are scored with that run's validation settings and seeds, exactly as rollout server 0 would
have scored them during the job (`rollout_servers.validation.Validator`), but on no job's clock and on no engine that
generation needs. Several runs share the one engine, so two modes compared are scored by one evaluator."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from asyncrl.config import AsyncRLConfig, load_config
from asyncrl.logs import setup_logging
from asyncrl.snapshots import EVALUATION_FILE, made_times, read_evaluation, snapshot_path

log = logging.getLogger("evaluate")

# What the one engine is built from: runs that differ in any of these need an engine each (separate calls).
ENGINE_KEYS = ("model", "rollout.engine", "reward", "environment")


@dataclasses.dataclass(frozen=True)
class Run:
    directory: Path
    config: AsyncRLConfig
    made: dict[int, float]  # each snapshot's version and the Unix time the learner made it
    pending: list[int]  # versions with a snapshot and no score yet, in order


def main(args: argparse.Namespace) -> NoReturn:
    """Score, then leave at once, as the synchronous reference does (launch/commands/reference.py says why)."""
    code = evaluate(args)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def evaluate(args: argparse.Namespace) -> int:
    runs = [read_run(Path(directory)) for directory in args.run_dirs]
    if problem := engine_mismatch(runs):
        print(f"asyncrl evaluate: {problem}", file=sys.stderr)
        return 2
    setup_logging("evaluate", runs[0].config.run.log_level)
    todo = [run for run in runs if run.pending]
    for run in runs:
        log.info("%s: %d snapshot(s) to score%s", run.directory, len(run.pending),
                 "" if run.pending else " (every one is scored already)")
    if todo:
        score_all(todo)
    return 0


def read_run(directory: Path) -> Run:
    """The run's resolved config and its snapshots not scored yet; SystemExit naming what is missing."""
    config_file = directory / "config.yaml"
    if not config_file.is_file():
        raise SystemExit(f"asyncrl evaluate: {directory} is not a run directory (no config.yaml)")
    config = load_config(str(config_file), [])
    made = made_times(directory)
    if not made:
        raise SystemExit(f"asyncrl evaluate: {directory} has no weight snapshots: run the job with "
                         "validation.after_run=true (and validation.every > 0)")
    scored = read_evaluation(directory)
    return Run(directory, config, made, [version for version in sorted(made) if version not in scored])


def engine_mismatch(runs: list[Run]) -> str | None:
    """Which engine setting the runs do not share (they would need an engine each), or None."""
    first = runs[0]
    for run in runs[1:]:
        for key in ENGINE_KEYS:
            if _section(first.config, key) != _section(run.config, key):
                return (f"{run.directory} and {first.directory} differ in {key}: one engine cannot score both; "
                        "evaluate them in separate calls")
    return None


def _section(config: AsyncRLConfig, key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    if key == "rollout.engine":  # the memory share a plan lowered beside a learner: the evaluator runs alone
        value = dataclasses.replace(value, gpu_memory_utilization=0.0)
    return value


def score_all(runs: list[Run]) -> None:
    """Start the engine once, then load and score each pending snapshot of each run."""
    import torch  # after parsing: `asyncrl --help` stays instant

    from asyncrl.weight_transfer.backends import group_backend
    from rollout_servers.reference_sampler import ReferenceSampler
    from rollout_servers.validation import Validator, load_validation_prompts

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    sampler = ReferenceSampler.start(runs[0].config, None, group_backend(receiver_has_own_gpus=False))
    try:
        loads = 0  # the engine's version for each load: never one it held, so no prompt's cache is reused
        total = sum(len(run.pending) for run in runs)
        for run in runs:
            settings = run.config.validation
            prompts = load_validation_prompts(run.config, sampler.tokenizer)
            validator = Validator(settings, run.config.rollout.sampling, prompts, sampler.tokenizer, run.config.run.seed)
            for version in run.pending:
                loads += 1
                weights = torch.load(snapshot_path(run.directory, version), map_location=sampler.weights_device,
                                     weights_only=True)
                sampler.load_weights(loads, weights)
                del weights
                metrics = sampler.score(validator)
                record_score(run.directory, version, run.made[version], metrics)
                log.info("%s version %d: val/score/mean %.3f (%d of %d)", run.directory.name, version,
                         metrics["val/score/mean"], loads, total)
    finally:
        sampler.close()


def record_score(run_dir: Path, version: int, made_at: float, metrics: dict[str, float]) -> None:
    record = {"version": version, "made_at": made_at, "evaluated_at": time.time(), **metrics}
    with (run_dir / EVALUATION_FILE).open("a") as out:
        out.write(json.dumps(record) + "\n")
