"""Output tokens/s of one rollout server's generation path against raw vLLM offline generation.

Both phases run the same workload on the same engine settings (`rollout.engine` and
`rollout.max_inflight` of the config), one after the other, each in its own process so that only one
engine holds memory and cores at a time:
  raw vLLM   `vllm.LLM.generate` on all prompts at once, `n` samples each; batches without log-probs
             alternate with batches that also return each sampled token's log-prob (the one extra
             output RL needs), so the cost of that output is seen apart from the server's own
  server     `RolloutEngine.generate_group` for every prompt at once, as a server runs it: `AsyncLLM`,
             one streamed request per sample, behaviour log-probs and per-token policy versions
Workload: --num-prompts prompts from the config's validation file (the synthetic task), --n samples
each, exactly --max-tokens output tokens per sample (`ignore_eos`). Each phase first generates an
untimed warm-up batch (vLLM's first steps are slow on CPU), then times the workload --repeats times.
On a shared machine other processes slow some repeats down, so the headline is each path's best
repeat (closest to what the code can do); the medians are reported beside it.
Run with scripts/cpu_env.sh sourced on CPU.
Last line: RESULT {json} with server_tok_s, raw_vllm_tok_s and ratio (server / raw, best repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.config import AsyncRLConfig, load_config
from asyncrl.data import encode_prompt, load_prompt_file

DEFAULT_CONFIG = "configs/quickstart.yaml"
PHASE_TIMEOUT_S = 900  # an engine start plus warm-up plus the workload; no phase may hang the benchmark
EXIT_GRACE_S = 60  # a phase process that has reported gets this long to stop its engine and exit
WARMUP_PROMPTS = 2  # prompts of the untimed first batch
SPAWN = multiprocessing.get_context("spawn")  # vLLM starts its own processes; a forked child would break them
# The settings of `rollout_servers.engine_args.engine_args` that shape generation; the raw engine takes
# the same values so that only the generation path differs.
SHARED_ENGINE_FIELDS = (
    "dtype", "max_model_len", "tensor_parallel_size", "gpu_memory_utilization", "kv_cache_memory_bytes",
    "enforce_eager", "seed", "logprobs_mode", "max_num_seqs", "disable_log_stats",
)


RAW = "raw vLLM (LLM.generate)"
RAW_LOGPROBS = "raw vLLM + sampled log-probs"
SERVER = "rollout server (generate_group)"


@dataclass
class PhaseResult:
    name: str  # which generation path
    output_tokens: int  # completion tokens produced by one timed batch
    seconds: list[float]  # wall time of each timed batch
    start_s: float  # engine start
    warmup_s: float  # untimed first batch

    @property
    def best_tokens_per_s(self) -> float:
        return self.output_tokens / min(self.seconds)

    @property
    def median_tokens_per_s(self) -> float:
        return self.output_tokens / statistics.median(self.seconds)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="asyncrl config giving the engine settings")
    parser.add_argument("--model", default=None, help="model directory (default: the config's model.path, "
                        "built with the tiny-model recipe when missing)")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts in the timed batch")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per sample (EOS ignored)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (a group)")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per path")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. rollout.max_inflight=32")
    return parser.parse_args()


def load_settings(args: argparse.Namespace) -> AsyncRLConfig:
    sampling = [f"rollout.sampling.max_tokens={args.max_tokens}", f"rollout.sampling.n={args.n}",
                "rollout.sampling.ignore_eos=true"]
    model = [f"model.path={args.model}"] if args.model else []
    return load_config(args.config, [*args.overrides, *sampling, *model])


def ensure_model(config: AsyncRLConfig) -> None:
    """Build the tiny model at model.path when nothing is there (cached, minutes on CPU)."""
    if Path(config.model.path).is_dir():
        return
    from asyncrl.tiny.build import init_model

    print(f"no model at {config.model.path}: building the tiny model", flush=True)
    init_model(config)


def workload_prompts(config: AsyncRLConfig, count: int) -> list[list[int]]:
    """`count` prompt token lists from the validation files, cycling when they hold fewer rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    rows = [row for path in config.data.val_files for row in load_prompt_file(path)]
    prompts = [encode_prompt(tokenizer, rows[index % len(rows)]) for index in range(count)]
    longest = max(len(p) for p in prompts) + config.rollout.sampling.max_tokens
    if longest > config.rollout.engine.max_model_len:
        raise SystemExit(f"prompt + --max-tokens needs {longest} tokens > rollout.engine.max_model_len="
                         f"{config.rollout.engine.max_model_len}: pass rollout.engine.max_model_len={longest}")
    return prompts


# ----------------------------------------------------------------------------------------------
# Phases (each runs in a child process)


def raw_vllm_phase(config: AsyncRLConfig, prompts: list[list[int]], warmup: list[list[int]], repeats: int) -> list[PhaseResult]:
    """`LLM.generate` without and with the sampled token's log-prob, alternating batch by batch so that
    both see the same load."""
    from vllm import LLM, SamplingParams

    from rollout_servers.engine_args import SAMPLED_TOKEN_ONLY, engine_args

    args = engine_args(config.model.path, config.rollout.engine, config.rollout.max_inflight)
    started = time.perf_counter()
    llm = LLM(model=config.model.path, **{name: getattr(args, name) for name in SHARED_ENGINE_FIELDS})
    start_s = time.perf_counter() - started
    sampling = config.rollout.sampling
    plain, with_logprobs = (
        SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                       max_tokens=sampling.max_tokens, ignore_eos=True, logprobs=logprobs)
        for logprobs in (None, SAMPLED_TOKEN_ONLY)
    )

    def generate(batch: list[list[int]], params: SamplingParams) -> tuple[int, float]:
        began = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs), time.perf_counter() - began

    try:
        _, warmup_s = generate(warmup, with_logprobs)
        timed = [(generate(prompts, plain), generate(prompts, with_logprobs)) for _ in range(repeats)]
    finally:
        llm.llm_engine.engine_core.shutdown()  # else the child waits on its engine process at exit
    return [
        PhaseResult(RAW, timed[0][0][0], [run[0][1] for run in timed], start_s, warmup_s),
        PhaseResult(RAW_LOGPROBS, timed[0][1][0], [run[1][1] for run in timed], start_s, warmup_s),
    ]


def server_phase(config: AsyncRLConfig, prompts: list[list[int]], warmup: list[list[int]], repeats: int) -> list[PhaseResult]:
    from rollout_servers.engine import RolloutEngine

    async def measure() -> PhaseResult:
        started = time.perf_counter()
        engine = await RolloutEngine.start(config.model.path, config.rollout)
        start_s = time.perf_counter() - started

        async def generate(batch: list[list[int]]) -> tuple[int, float]:
            began = time.perf_counter()
            groups = await asyncio.gather(*(engine.generate_group(ids) for ids in batch))
            return sum(len(c.token_ids) for group in groups for c in group), time.perf_counter() - began

        try:
            _, warmup_s = await generate(warmup)
            timed = [await generate(prompts) for _ in range(repeats)]
        finally:
            engine.shutdown()
        return PhaseResult(SERVER, timed[0][0], [s for _, s in timed], start_s, warmup_s)

    return [asyncio.run(measure())]


def _phase_child(phase, config: AsyncRLConfig, prompts, warmup, repeats: int, results: multiprocessing.Queue) -> None:
    results.put([asdict(result) for result in phase(config, prompts, warmup, repeats)])


def run_phase(phase, config: AsyncRLConfig, prompts: list[list[int]], warmup: list[list[int]], repeats: int) -> list[PhaseResult]:
    """`phase` in a fresh process; its engine is gone when this returns."""
    results = SPAWN.Queue()
    child = SPAWN.Process(target=_phase_child, args=(phase, config, prompts, warmup, repeats, results))
    child.start()
    try:
        reported = [PhaseResult(**fields) for fields in results.get(timeout=PHASE_TIMEOUT_S)]
    finally:
        child.join(EXIT_GRACE_S)
        if child.is_alive():
            child.terminate()
    return reported


# ----------------------------------------------------------------------------------------------
# Report


def print_table(results: list[PhaseResult]) -> None:
    print(f"{'path':<34}{'tokens/batch':>13}{'best tok/s':>11}{'median tok/s':>13}{'start s':>9}{'warm-up s':>11}  batch seconds")
    for r in results:
        batches = " ".join(f"{s:.2f}" for s in r.seconds)
        print(f"{r.name:<34}{r.output_tokens:>13}{r.best_tokens_per_s:>11.0f}{r.median_tokens_per_s:>13.0f}"
              f"{r.start_s:>9.1f}{r.warmup_s:>11.1f}  {batches}")


def main() -> None:
    args = parse_args()
    config = load_settings(args)
    ensure_model(config)
    prompts = workload_prompts(config, args.num_prompts)
    warmup = prompts[:WARMUP_PROMPTS]
    raw, raw_logprobs = run_phase(raw_vllm_phase, config, prompts, warmup, args.repeats)
    (server,) = run_phase(server_phase, config, prompts, warmup, args.repeats)
    sampling = config.rollout.sampling
    print(f"{args.num_prompts} prompts x {sampling.n} samples x {sampling.max_tokens} output tokens, "
          f"max_inflight {config.rollout.max_inflight}, model {config.model.path}, "
          f"{os.cpu_count()} CPUs visible")
    print_table([raw, raw_logprobs, server])
    print("RESULT " + json.dumps({
        "server_tok_s": round(server.best_tokens_per_s, 1),
        "raw_vllm_tok_s": round(raw.best_tokens_per_s, 1),
        "ratio": round(server.best_tokens_per_s / raw.best_tokens_per_s, 3),
        "server_tok_s_median": round(server.median_tokens_per_s, 1),
        "raw_vllm_tok_s_median": round(raw.median_tokens_per_s, 1),
        "ratio_median": round(server.median_tokens_per_s / raw.median_tokens_per_s, 3),
        "raw_vllm_logprobs_tok_s": round(raw_logprobs.best_tokens_per_s, 1),
        "ratio_vs_raw_logprobs": round(server.best_tokens_per_s / raw_logprobs.best_tokens_per_s, 3),
        "repeats": args.repeats,
        "num_prompts": args.num_prompts,
        "n": sampling.n,
        "max_tokens": sampling.max_tokens,
        "max_inflight": config.rollout.max_inflight,
        "server_output_tokens_per_batch": server.output_tokens,
        "raw_output_tokens_per_batch": raw.output_tokens,
    }))


if __name__ == "__main__":
    main()
