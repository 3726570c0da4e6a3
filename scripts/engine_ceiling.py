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

A table, then `RESULT {json}` with `ceiling_tokens_per_s`; --out also writes that JSON to a file
(scripts/bench_time_to_score.py reads it as the one-GPU ceiling). --start-only starts the engine, samples one token
and stops, measuring nothing: vLLM compiles the model's graphs (and at the first request, parts of its sampler) into
the host's caches once, so that a job started later does not pay for it (the first engine on an H200 host took 80 s to
start, the next 15-20 s). Run with scripts/cpu_env.sh sourced on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from asyncrl.config import AsyncRLConfig, load_config
from asyncrl.config_arguments import add_config_arguments
from asyncrl.data import encode_prompt, load_prompt_file
from asyncrl.heap import leave_now
from asyncrl.whole_files import write_json_whole
from rollout_servers.cancelled import cancel_and_wait
from rollout_servers.sample_slots import SampleSlots

PROMPT_SEED = 0  # the order the training prompts are drawn in


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


async def measure(config: AsyncRLConfig, prompts: list[list[int]], warmup_s: float, seconds: float) -> dict[str, Any]:
    """Start the job's engine on its starting model, then keep it full (`keep_full`)."""
    engine, start_s = await start_engine(config)
    try:
        result = await keep_full(engine, prompts, config.rollout.sampling, config.rollout.max_inflight, warmup_s, seconds)
    finally:
        engine.shutdown()
    return result | {"engine_start_s": round(start_s, 1), "max_tokens": config.rollout.sampling.max_tokens}


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
    for title, key in rows:
        print(f"{title:40}{result[key]!s:>14}")


async def start_engine(config: AsyncRLConfig) -> tuple[Any, float]:
    """The job's engine started on its starting model (a `RolloutEngine`), and the seconds its start took."""
    from rollout_servers.engine import RolloutEngine

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
    result = asyncio.run(measure(config, training_prompts(config), args.warmup_s, args.seconds))
    print_table(result)
    if args.out:
        write_json_whole(Path(args.out), result)  # the race reads it: never half of it
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    leave_now(0)  # the engine is shut down: vLLM's client, finalised in the interpreter's teardown, raises there
