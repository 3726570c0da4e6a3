"""The engine kept full: the output tokens/s one rollout engine reaches on a job's own task when it is never short of
work, the ceiling of the async job's trained tokens/s on one GPU (training and weight loads hidden, every
generated token trained).

One `RolloutEngine` (the server's generation path) on the job's starting model (`model.path`) samples the job's
training prompts in a seeded random order with the job's sampling settings, natural lengths (stopping at EOS or
`rollout.sampling.max_tokens`), in groups of `rollout.sampling.n` samples of one prompt as the servers send them,
keeping `rollout.max_inflight` samples running as a server does (`SampleSlots`, its own count): a sample's slot is
free when that sample finishes, and a new group starts as soon as a group's worth of slots are free, whether or not
the groups they came from still run. (Replacing only whole finished groups left each group's finished samples'
slots idle until its longest one ended: 18.8k tokens/s on an H200 where the async job itself trained 23.5k; and
single-sample requests read 17.4k where it trained 22.8k.) After --warmup-s, the completion tokens sampled over
--seconds (finished requests' and the partial ones of those still running, both counted by the engine) give the rate.

With `rollout.num_servers` above 1 (several servers on the GPUs: vLLM's engine core is one process on one CPU core,
and a small model's steps can leave the GPU idle while it schedules), that many engines, each in a process of its own
as the servers run (its own engine core and front end), each with its part of the engine's memory share
(`rollout.engine.gpu_memory_utilization` / their number) and `rollout.max_inflight` samples, start one at a time (a
GPU's start turn, `rollout_servers.engine_turns`), then are kept full at once: the ceiling is the sum of their rates
over windows that open together.

A table, then `RESULT {json}` with `ceiling_tokens_per_s`; --out also writes that JSON to a file
(scripts/bench_time_to_score.py reads it as the one-GPU ceiling). --start-only starts the engine, samples one token
and stops, measuring nothing: vLLM compiles the model's graphs (and at the first request, parts of its sampler) into
the host's caches once, so that a job started later does not pay for it (the first engine on an H200 host took 80 s to
start, the next 15-20 s). Run with scripts/cpu_env.sh sourced on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import itertools
import json
import multiprocessing
import random
import statistics
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable

from asyncrl.config import AsyncRLConfig, load_config
from asyncrl.config_arguments import add_config_arguments
from asyncrl.data import encode_prompt, load_prompt_file
from asyncrl.heap import leave_now
from asyncrl.parent_death import die_with_spawning_parent
from asyncrl.whole_files import write_json_whole
from rollout_servers.cancelled import cancel_and_wait
from rollout_servers.sample_slots import SampleSlots

PROMPT_SEED = 0  # the order the training prompts are drawn in
START_TIMEOUT_S = 900.0  # the longest one of several engines may take to start, or wait for the others to
RECEIVE_POLL_S = 1.0  # how often the word of one of several engines is looked for, and its process checked
STARTED, GO = "started", "go"  # one of several engines to the measure's process, and its answer once all have started


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "configs/gpu_longtail.yaml")
    parser.add_argument("--warmup-s", type=float, default=15.0, help="seconds generated before the window opens")
    parser.add_argument("--seconds", type=float, default=60.0, help="the timed window, in seconds")
    parser.add_argument("--out", default="", help="also write the RESULT JSON to this file")
    parser.add_argument("--start-only", action="store_true",
                        help="start the job's engine and stop (fills vLLM's compile cache on this host), no measure")
    return parser.parse_args()


def training_prompts(config: AsyncRLConfig) -> list[list[int]]:
    """Every training prompt's ids, rendered as the servers render them, in a seeded random order."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    prompts = [encode_prompt(tokenizer, row) for path in config.data.train_files for row in load_prompt_file(path)]
    random.Random(PROMPT_SEED).shuffle(prompts)
    return prompts


async def measure(config: AsyncRLConfig, prompts: list[list[int]], warmup_s: float, seconds: float,
                  all_started: Callable[[], None] = lambda: None, name: str = "engine-0") -> dict[str, Any]:
    """Start the job's engine on its starting model, then, once `all_started` returns (the other engines have
    started too), keep it full (`keep_full`)."""
    engine, start_s = await start_engine(config, name)
    try:
        all_started()
        result = await keep_full(engine, prompts, config.rollout.sampling, config.rollout.max_inflight, warmup_s, seconds)
    finally:
        engine.shutdown()
    return result | {"engine_start_s": round(start_s, 1), "max_tokens": config.rollout.sampling.max_tokens}


def measure_engines(config: AsyncRLConfig, prompts: list[list[int]], warmup_s: float, seconds: float) -> dict[str, Any]:
    """The ceiling of `rollout.num_servers` engines: one measured here, or several, each in a process of its own
    (`engine_process`) with its part of the memory share and its own turn through the prompts, kept full at once
    once all have started; their figures added up (`combined`)."""
    count = config.rollout.num_servers
    if count == 1:
        return asyncio.run(measure(config, prompts, warmup_s, seconds))
    config = copy.deepcopy(config)
    config.rollout.engine.gpu_memory_utilization /= count
    context = multiprocessing.get_context("spawn")  # vLLM starts processes of its own: a forked child would break them
    pipes = [context.Pipe() for _ in range(count)]
    processes = [context.Process(target=engine_process, name=f"engine-{index}",
                                 args=(config, rotated(prompts, index, count), warmup_s, seconds, index, child_end))
                 for index, (_, child_end) in enumerate(pipes)]
    for process in processes:
        process.start()
    try:
        for process, (ours, _) in zip(processes, pipes):
            receive(process, ours, START_TIMEOUT_S)  # started
        for ours, _ in pipes:
            ours.send(GO)
        return combined([receive(process, ours, warmup_s + seconds + START_TIMEOUT_S)
                         for process, (ours, _) in zip(processes, pipes)])
    finally:
        for process in processes:
            process.kill()
            process.join()


def rotated(prompts: list[list[int]], index: int, count: int) -> list[list[int]]:
    """The prompts from the `index`-th of `count` equal parts on, then the rest: each engine its own turn through them."""
    start = index * len(prompts) // count
    return prompts[start:] + prompts[:start]


def engine_process(config: AsyncRLConfig, prompts: list[list[int]], warmup_s: float, seconds: float, index: int,
                   parent: Connection) -> None:
    """One engine of several, in its own process: says on `parent` once its engine has started, is measured once the
    parent says every engine has (GO), then sends its figures."""
    die_with_spawning_parent()  # a measure killed outright takes its engines along (their cores die with them)

    def all_started() -> None:
        parent.send(STARTED)
        parent.recv()

    parent.send(asyncio.run(measure(config, prompts, warmup_s, seconds, all_started, f"engine-{index}")))
    leave_now(0)  # the figures are sent: vLLM's client, finalised in the interpreter's teardown, raises there


def receive(process: BaseProcess, ours: Connection, timeout_s: float) -> Any:
    """What `process` sends next on `ours`; SystemExit naming it where it ends without sending, or sends nothing
    within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ours.poll(RECEIVE_POLL_S):
        if not process.is_alive():
            raise SystemExit(f"{process.name} exited with {process.exitcode} (its log above)")
        if time.monotonic() > deadline:
            raise SystemExit(f"{process.name} sent nothing in {timeout_s:.0f}s")
    return ours.recv()


def combined(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several engines' figures as one generation side's: their rates, tokens, samples and slots added up, the mean
    length over all their finished samples, the slowest start; each engine's own rate kept."""
    finished = sum(result["samples_finished"] for result in results)
    lengths = sum(result["length_mean"] * result["samples_finished"] for result in results if result["length_mean"])
    return {
        "ceiling_tokens_per_s": round(sum(result["ceiling_tokens_per_s"] for result in results), 1),
        "window_s": max(result["window_s"] for result in results),
        "tokens": sum(result["tokens"] for result in results),
        "samples_finished": finished,
        "length_mean": round(lengths / finished, 1) if finished else None,
        "max_inflight": sum(result["max_inflight"] for result in results),
        "group_size": results[0]["group_size"],
        "in_flight_at_end": sum(result["in_flight_at_end"] for result in results),
        "engine_start_s": max(result["engine_start_s"] for result in results),
        "max_tokens": results[0]["max_tokens"],
        "engines": len(results),
        "engine_tokens_per_s": [result["ceiling_tokens_per_s"] for result in results],
    }


async def keep_full(engine: Any, prompts: list[list[int]], sampling: Any, in_flight: int, warmup_s: float,
                    seconds: float) -> dict[str, Any]:
    """Keep `in_flight` samples of `sampling` running in `engine` (a `RolloutEngine`) as a server does, in groups of
    `sampling.n` of one prompt cycling through `prompts`; the completion tokens it samples in the `seconds` after
    `warmup_s`, finished and partial."""
    lengths: list[int] = []
    next_prompt = itertools.cycle(prompts)
    slots = SampleSlots(in_flight)
    slot_freed = asyncio.Event()
    groups: set[asyncio.Task] = set()
    failed: list[BaseException] = []

    async def one_group() -> None:
        claim = slots.claim(sampling.n)

        def sample_done() -> None:
            claim.sample_done()
            slot_freed.set()

        try:
            group = await engine.generate_group(next(next_prompt), sampling, on_sample_done=sample_done)
            lengths.extend(len(completion.token_ids) for completion in group)
        finally:
            claim.release()
            slot_freed.set()

    def group_ended(group: asyncio.Task) -> None:
        groups.discard(group)
        if not group.cancelled() and group.exception() is not None:
            failed.append(group.exception())

    async def keep_filling() -> None:  # until a group fails, or cancelled when the window closes
        while not failed:
            for _ in range(slots.free_groups(sampling.n, len(groups))):
                group = asyncio.create_task(one_group())
                groups.add(group)
                group.add_done_callback(group_ended)
            slot_freed.clear()  # no await since the count was read: no slot can have been freed unseen
            await slot_freed.wait()

    def sampled() -> int:
        return engine.tokens_sampled + sum(engine.inflight_tokens().values())

    filler = asyncio.create_task(keep_filling())
    try:
        await asyncio.sleep(warmup_s)
        window_start, tokens_start, finished_start = time.perf_counter(), sampled(), len(lengths)
        await asyncio.sleep(seconds)
        window_s, tokens = time.perf_counter() - window_start, sampled() - tokens_start
        in_flight_at_end = engine.inflight_requests
    finally:
        await cancel_and_wait([filler, *groups])
    if failed:  # the engine was not kept full: the rate would understate it
        raise RuntimeError(f"{len(failed)} groups failed while the engine was kept full") from failed[0]
    finished = lengths[finished_start:]
    return {"ceiling_tokens_per_s": round(tokens / window_s, 1), "window_s": round(window_s, 1), "tokens": tokens,
            "samples_finished": len(finished), "length_mean": round(statistics.fmean(finished), 1) if finished else None,
            "max_inflight": in_flight, "group_size": sampling.n, "in_flight_at_end": in_flight_at_end}


def print_table(result: dict[str, Any]) -> None:
    rows = [("output tokens/s, engine kept full", "ceiling_tokens_per_s"), ("timed window (s)", "window_s"),
            ("samples finished in the window", "samples_finished"), ("their mean length (tokens)", "length_mean"),
            ("samples kept in flight", "max_inflight"), ("samples per group (one prompt)", "group_size"),
            ("in flight when the window closed", "in_flight_at_end"),
            ("engine start (s)", "engine_start_s")]
    if "engines" in result:
        rows += [("engines, each in its own process", "engines"), ("each one's output tokens/s", "engine_tokens_per_s")]
    for title, key in rows:
        print(f"{title:40}{result[key]!s:>14}")


async def start_engine(config: AsyncRLConfig, name: str = "engine-0") -> tuple[Any, float]:
    """The job's engine started on its starting model (a `RolloutEngine`) in its GPUs' start turn, and the seconds its
    start took (the wait for the turn left out)."""
    from asyncrl.gpu_ids import visible_gpus
    from rollout_servers.engine import RolloutEngine
    from rollout_servers.engine_turns import engine_start_turn

    with engine_start_turn(visible_gpus(), START_TIMEOUT_S, name):
        started = time.perf_counter()
        engine = await RolloutEngine.start(config.model.path, config.rollout, gpu_memory_gib=config.run.gpu_memory_gib)
        return engine, time.perf_counter() - started


async def start_only(config: AsyncRLConfig) -> float:
    """Start the job's engine, sample one token and shut it down, so that what vLLM compiles at its start (the model's
    graphs) and at its first request (parts of its sampler) is in this host's caches; the seconds its start took."""
    engine, start_s = await start_engine(config)
    try:
        await engine.generate([0], dataclasses.replace(config.rollout.sampling, max_tokens=1))
    finally:
        engine.shutdown()
    return start_s


def main() -> None:
    args = parse_args()
    config = load_config(args.config, args.overrides)
    if args.start_only:
        print(f"the job's engine started in {asyncio.run(start_only(config)):.1f}s: vLLM's compile cache holds it now",
              flush=True)
        return
    result = measure_engines(config, training_prompts(config), args.warmup_s, args.seconds)
    print_table(result)
    if args.out:
        write_json_whole(Path(args.out), result)  # the race reads it: never half of it
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    leave_now(0)  # the engine is shut down: vLLM's client, finalised in the interpreter's teardown, raises there
