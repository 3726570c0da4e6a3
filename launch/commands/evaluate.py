"""`asyncrl evaluate RUN_DIR...`: score the weight snapshots of jobs run with `validation.after_run` (asyncrl/snapshots.py)
on their held-out prompts, after the jobs, on vLLM engines of this command's own (--engines: spread over its GPUs).

Each run's snapshots are scored with that run's validation settings and seeds, exactly as rollout server 0 would
have scored them during the job (`rollout_servers.validation.Validator`), but on no job's clock and on no engine that
generation needs. Several runs share the one engine, so two modes compared are scored by one evaluator."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

from asyncrl.config import AsyncRLConfig, load_config
from asyncrl.gpu_ids import pin, visible_gpus
from asyncrl.heap import ended_normally, leave_now
from asyncrl.logs import setup_logging
from asyncrl.memory_plan import ENGINE_OVER_SHARE, SENDER_CONTEXT, shared_engine_fraction
from asyncrl.parent_death import die_with_spawning_parent
from asyncrl.snapshots import EVALUATION_FILE, made_times, snapshot_path, unscored_versions

log = logging.getLogger("evaluate")

# What the one engine is built from: runs that differ in any of these need an engine each (separate calls).
ENGINE_KEYS = ("model", "rollout.engine", "reward", "environment")
ENGINE_START_POLL_S = 1.0  # how often --engines checks whether the engine starting now has started or died


@dataclasses.dataclass(frozen=True)
class Run:
    directory: Path
    config: AsyncRLConfig
    made: dict[int, float]  # each snapshot's version and the Unix time the learner made it
    pending: list[int]  # versions with a snapshot file and no score yet, in order
    lost: list[int]  # versions with no score whose snapshot file is gone: they stay unscored


def main(args: argparse.Namespace) -> NoReturn:
    """Score, then leave at once, as the synchronous reference does (launch/commands/reference.py says why)."""
    leave_now(evaluate(args))


def evaluate(args: argparse.Namespace) -> int:
    engines = engine_count(args.engines or "1")
    runs = [read_run(Path(directory)) for directory in args.run_dirs]
    if problem := engine_mismatch(runs):
        print(f"asyncrl evaluate: {problem}", file=sys.stderr)
        return 2
    setup_logging("evaluate", runs[0].config.run.log_level)
    for run in runs:
        log.info("%s: %d snapshot(s) to score%s", run.directory, len(run.pending),
                 "" if run.pending or run.lost else " (every one is scored already)")
        if run.lost:
            log.warning("%s: version(s) %s have no score and no snapshot file (gone with the host that made them, or "
                        "never copied here): they stay unscored", run.directory, ", ".join(map(str, run.lost)))
    engines = min(engines, sum(len(run.pending) for run in runs))  # never an engine with nothing to score
    if engines > 1:
        return score_on_engines(runs, engine_places(engines, visible_gpus(), runs[0].config), args.drop_scored)
    if engines:
        score_all(runs, drop_scored=args.drop_scored)
    return 0


def engine_count(text: str) -> int:
    """--engines as a number of engines, at least 1; SystemExit naming the option otherwise."""
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"asyncrl evaluate: --engines must be a whole number >= 1, not {text!r}")
    return int(text)


Item = tuple[Path, int]  # a snapshot to score: its run's directory and its version


def work_items(runs: list[Run]) -> list[Item]:
    """Every snapshot left to score, the runs' versions taken in turn (one of each run, then the next of each), so
    that runs compared are scored side by side."""
    rounds = max((len(run.pending) for run in runs), default=0)
    return [(run.directory, run.pending[index]) for index in range(rounds) for run in runs if index < len(run.pending)]


@dataclasses.dataclass(frozen=True)
class Work:
    """The snapshots several engines score, handed out one at a time to whichever engine asks first: an engine that
    started earlier (they start in turn on a GPU) or scores faster takes more."""

    items: list[Item]
    taken: Any  # a multiprocessing Value('i') the engines share: how many items have been handed out
    snapshot_bytes: int  # the size of each snapshot: what the weight buffer an engine maps holds

    @classmethod
    def of(cls, runs: list[Run], context: Any = multiprocessing) -> Work:
        """The runs' snapshots left to score (`work_items`), none handed out yet; `context` makes the counter (a
        spawn context's for processes it starts)."""
        items = work_items(runs)
        size = snapshot_path(*items[0]).stat().st_size if items else 0  # read now: --drop-scored deletes them
        return cls(items, context.Value("i", 0), size)

    def take(self) -> Item | None:
        with self.taken.get_lock():
            index = self.taken.value
            if index >= len(self.items):
                return None
            self.taken.value = index + 1
        return self.items[index]


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one of several engines runs."""

    gpu: int | None  # the one GPU its process sees (None: every GPU this process sees)
    sharing: int  # engines on its GPUs, itself included: each takes that part of gpu_memory_utilization


def engine_places(engines: int, gpus: list[int], config: AsyncRLConfig) -> list[Place]:
    """Each engine's place: dealt out in turn over `gpus` when there are several and an engine needs one GPU
    (`rollout.engine.tensor_parallel_size` 1), so that no GPU idles while another scores; all on every GPU otherwise."""
    if len(gpus) < 2 or config.rollout.engine.tensor_parallel_size != 1:
        return [Place(None, engines)] * engines
    chosen = [gpus[number % len(gpus)] for number in range(engines)]
    return [Place(gpu, chosen.count(gpu)) for gpu in chosen]


def score_on_engines(runs: list[Run], places: list[Place], drop_scored: bool = False) -> int:
    """Score the runs' snapshots on an engine per place (`engine_places`), each in a process of its own and
    taking its part of its GPU's `rollout.engine.gpu_memory_utilization`, each taking the next snapshot left as soon
    as it is free (`Work`); 1 if any failed.

    Every process starts at once and imports while it waits for its turn; the engines sharing GPUs start one after
    the other, each once the one before has started (or died), engines on GPUs of their own at once, and none closes
    before the last has started. vLLM sizes its KV cache from the GPU memory it sees while it starts: another engine
    starting beside it would distort that, and one closing beside it (memory freed) stops it with "Error in memory
    profiling"."""
    context = multiprocessing.get_context("spawn")  # vLLM starts processes of its own: a forked child would break them
    orders = [StartOrder(context.Event(), context.Event()) for _ in places]
    all_started = context.Event()
    work = Work.of(runs, context)
    directories = [run.directory for run in runs]
    workers = [context.Process(target=score_share, name=f"evaluate-engine-{number}",
                               args=(directories, work, place, order, all_started, drop_scored))
               for number, (place, order) in enumerate(zip(places, orders))]
    for worker in workers:
        worker.start()
    start_in_turn(queues_by_gpu([(worker.is_alive, order) for worker, order in zip(workers, orders)], places),
                  all_started)
    for worker in workers:
        worker.join()
    failed = [worker.name for worker in workers if worker.exitcode != 0]
    for name in failed:
        log.error("%s failed: the version it was scoring stays unscored (run asyncrl evaluate again)", name)
    return 1 if failed else 0


@dataclasses.dataclass(frozen=True)
class StartOrder:
    """One engine's place in the order the engines start in (multiprocessing Events, shared with its process)."""

    turn: Any  # set by the parent: this engine may start now
    started: Any  # set by the engine's process once its engine has started


Engine = tuple[Callable[[], bool], StartOrder]  # an engine's liveness check and its place in the order


def queues_by_gpu(engines: list[Engine], places: list[Place]) -> list[list[Engine]]:
    """The engines in start queues, one per GPU (one for all where every engine sees every GPU), each in their order."""
    queues: dict[int | None, list[Engine]] = {}
    for engine, place in zip(engines, places):
        queues.setdefault(place.gpu, []).append(engine)
    return list(queues.values())


def start_in_turn(queues: list[list[Engine]], all_started: Any) -> None:
    """Let each engine of a queue (the engines sharing GPUs) start once the one before it has started or died, the
    queues side by side, then tell them all (`all_started`) that they may close."""
    threads = [threading.Thread(target=_start_queue, args=(queue,), name=f"engine-start-{number}")
               for number, queue in enumerate(queues)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    all_started.set()


def _start_queue(engines: list[Engine]) -> None:
    for alive, order in engines:
        order.turn.set()
        while alive() and not order.started.wait(ENGINE_START_POLL_S):
            pass


def score_share(directories: list[Path], work: Work, place: Place, order: StartOrder, all_started: Any,
                drop_scored: bool = False) -> None:
    """One engine, in a process of its own: see only its place's GPU, read the runs and import the engine's modules,
    start the engine in its turn, score the snapshots it takes from `work` until none is left, and close it once
    every engine has started (`score_on_engines` says why)."""
    die_with_spawning_parent()  # the turn and the close wait on the parent: never outlive it
    if place.gpu is not None:  # before anything imports torch
        pin([place.gpu])
    runs = [read_run(directory) for directory in directories]
    setup_logging("evaluate", runs[0].config.run.log_level)
    import rollout_servers.reference_sampler  # noqa: F401 (seconds of imports, before this engine's turn)

    order.turn.wait()
    score_all(runs, place.sharing, on_started=order.started.set, before_close=all_started.wait, drop_scored=drop_scored,
              work=work)
    ended_normally()  # vLLM's client, finalised by the interpreter's teardown, raises there (`main`)


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
    return Run(directory, config, made, *unscored_versions(directory))


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


def score_all(runs: list[Run], engines: int = 1, on_started: Callable[[], None] | None = None,
              before_close: Callable[[], Any] | None = None, drop_scored: bool = False,
              work: Work | None = None) -> None:
    """Start the engine (with its part of the GPU's memory when `engines` share it) once, tell `on_started`, then
    load and score the snapshots `work` hands out one at a time until none is left (by default: every run's pending
    versions, `Work.of`), deleting each file once its score is written with `drop_scored`; call `before_close` (done
    or not) before closing the engine."""
    import torch  # after parsing: `asyncrl --help` stays instant

    from asyncrl.weight_transfer.backends import group_backend
    from rollout_servers.engine_args import gpu_card_bytes
    from rollout_servers.reference_sampler import ReferenceSampler
    from rollout_servers.validation import Validator, load_validation_prompts

    work = work or Work.of(runs)
    held_beyond = ENGINE_OVER_SHARE + SENDER_CONTEXT + work.snapshot_bytes  # the weight buffer: a snapshot's size
    sampler = ReferenceSampler.start(memory_part(runs[0].config, engines, held_beyond, gpu_card_bytes()), None,
                                     group_backend(receiver_has_own_gpus=False))
    if on_started is not None:
        on_started()
    try:
        by_directory = {run.directory: run for run in runs}
        validators: dict[Path, Validator] = {}  # each run's, built at its first snapshot
        loads = 0  # the engine's version for each load: never one it held, so no prompt's cache is reused
        while (item := work.take()) is not None:
            run, version = by_directory[item[0]], item[1]
            if run.directory not in validators:
                config = run.config
                prompts = load_validation_prompts(config, sampler.tokenizer)
                validators[run.directory] = Validator(config.validation, config.rollout.sampling, prompts,
                                                      sampler.tokenizer, config.run.seed)
            loads += 1
            # into host memory: on the GPU it would hold a second copy of the model beside the buffer the engine
            # maps, which the engines sharing the GPU did not leave room for (out of memory on an H100)
            weights = torch.load(snapshot_path(run.directory, version), map_location="cpu", weights_only=True)
            sampler.load_weights(loads, weights)
            del weights
            metrics = sampler.score(validators[run.directory])
            record_score(run.directory, version, run.made[version], metrics)
            if drop_scored:  # after the record: a version whose file is gone is always a scored one
                snapshot_path(run.directory, version).unlink()
            log.info("%s version %d: val/score/mean %.3f (%d scored by this engine, %d snapshots in all)",
                     run.directory.name, version, metrics["val/score/mean"], loads, len(work.items))
    finally:
        if before_close is not None:
            before_close()
        sampler.close()


def memory_part(config: AsyncRLConfig, engines: int, held_beyond: int = 0, card: int = 0) -> AsyncRLConfig:
    """`config` with its engine's share of GPU memory split between `engines` engines on the same GPUs of `card` bytes
    (0: not known), each holding `held_beyond` bytes outside its share (`shared_engine_fraction`)."""
    engine = config.rollout.engine
    fraction = shared_engine_fraction(engine.gpu_memory_utilization, engines, held_beyond, card)
    part = dataclasses.replace(engine, gpu_memory_utilization=fraction)
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, engine=part))


def record_score(run_dir: Path, version: int, made_at: float, metrics: dict[str, float]) -> None:
    record = {"version": version, "made_at": made_at, "evaluated_at": time.time(), **metrics}
    with (run_dir / EVALUATION_FILE).open("a") as out:
        out.write(json.dumps(record) + "\n")
