"""Output tokens/s of one rollout server's generation path against raw vLLM offline generation.

Both paths run the same workload on the same engine settings (`rollout.engine` and
`rollout.max_inflight` of the config), each in its own process with its engine resident; their timed
batches alternate (order flipped each round) so that both see the same load on a shared machine:
  raw vLLM   `vllm.LLM.generate` on all prompts at once, `n` samples each, vLLM's defaults (tokens and
             text, no log-probs, no seeds); batches alternate with ones asking what the server asks
             (tokens and each sampled token's log-prob, the one extra output RL needs, no text, and
             the server's per-sample seeds), so the cost of those requests is seen apart from the
             server's own
  server     `RolloutEngine.generate_group` for every prompt at once, as a server runs it: `AsyncLLM`,
             one request per sample, behaviour log-probs and per-token policy versions, each sample
             seeded as a server seeds it unless `rollout.seeded_sampling=false`
Workload: --num-prompts prompts from the config's validation file (the synthetic task), --n samples
each, exactly --max-tokens output tokens per sample (`ignore_eos`). Each path first generates an
untimed warm-up batch (vLLM's first steps are slow on CPU), then times the workload --repeats times.
On a shared machine other processes slow some repeats down, so the headline is each path's best
repeat (closest to what the code can do); the medians are reported beside it, and the geometric mean
of the per-round ratios with a ~95 % interval (`ratio_paired`: [mean, low, high]; a round's batches run
back to back, so pairing cancels most of the load that changes between rounds). CPU seconds per output
token of the generating process and of its engine processes are reported too: less sensitive to other
load than wall time, they show where each path spends its work.
Run with scripts/cpu_env.sh sourced on CPU.
Last line: RESULT {json} with server_tok_s, raw_vllm_tok_s and ratio (server / raw, best repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import queue
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from asyncrl.config import AsyncRLConfig, load_config
from asyncrl.config_arguments import add_config_arguments
from asyncrl.data import encode_prompt, load_prompt_file

DEFAULT_CONFIG = "configs/quickstart.yaml"
PHASE_TIMEOUT_S = 900  # an engine start plus warm-up, or one timed round; nothing may hang the benchmark
EXIT_GRACE_S = 60  # a path process told to stop gets this long to stop its engine and exit
CHILD_POLL_S = 1.0  # how often the parent checks that a path process it waits on is still alive
WARMUP_PROMPTS = 2  # prompts of the untimed first batch
SEED_BASE = 1_000  # sampling seed of the first prompt's group when seeded (a group's samples: seed + index)
SPAWN = multiprocessing.get_context("spawn")  # vLLM starts its own processes; a forked child would break them
# The settings of `rollout_servers.engine_args.engine_args` that shape generation; the raw engine takes
# the same values so that only the generation path differs.
SHARED_ENGINE_FIELDS = (
    "dtype", "max_model_len", "tensor_parallel_size", "gpu_memory_utilization", "kv_cache_memory_bytes",
    "enforce_eager", "seed", "logprobs_mode", "max_num_seqs", "disable_log_stats",
)


RAW = "raw vLLM (LLM.generate)"
RAW_LOGPROBS = "raw vLLM, server's requests"
SERVER = "rollout server (generate_group)"


@dataclass
class PhaseResult:
    name: str  # which generation path
    output_tokens: int  # completion tokens produced by one timed batch
    seconds: list[float]  # wall time of each timed batch
    start_s: float  # engine start
    warmup_s: float  # untimed first batch
    frontend_cpu_s: list[float]  # CPU seconds of the generating process in each timed batch
    engine_cpu_s: list[float]  # CPU seconds of its engine processes (vLLM's engine core) in each timed batch

    @property
    def best_tokens_per_s(self) -> float:
        return self.output_tokens / min(self.seconds)

    @property
    def median_tokens_per_s(self) -> float:
        return self.output_tokens / statistics.median(self.seconds)

    def cpu_us_per_token(self, cpu_s: list[float]) -> float:
        """The least CPU per output token over the batches (other load inflates it: cache misses, switches)."""
        return 1e6 * min(cpu_s) / self.output_tokens


class CpuClock:
    """CPU seconds used by this process and, separately, by its live child processes."""

    def __init__(self) -> None:
        self._me = psutil.Process()

    def read(self) -> tuple[float, float]:
        children = sum(_cpu_seconds(child) for child in self._me.children(recursive=True))
        return _cpu_seconds(self._me), children


def _cpu_seconds(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


@dataclass
class Batch:
    output_tokens: int
    seconds: float
    frontend_cpu_s: float
    engine_cpu_s: float


def phase_result(name: str, batches: list[Batch], start_s: float, warmup_s: float) -> PhaseResult:
    return PhaseResult(name, batches[0].output_tokens, [b.seconds for b in batches], start_s, warmup_s,
                       [b.frontend_cpu_s for b in batches], [b.engine_cpu_s for b in batches])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, DEFAULT_CONFIG, "config overrides, e.g. rollout.max_inflight=32")
    parser.add_argument("--model", default=None, help="model directory (default: the config's model.path, "
                        "built with the tiny-model recipe when missing)")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts in the timed batch")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per sample (EOS ignored)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (a group)")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per path")
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
    from demo.tiny.build import init_model
    from rollout_servers.rewards.builtin import scorer_for

    print(f"no model at {config.model.path}: building the tiny model", flush=True)
    init_model(config, scorer_for)


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


def group_seeds(config: AsyncRLConfig, count: int) -> list[int | None]:
    """Each prompt's group seed, spaced by `n` as a server spaces them; None each when unseeded."""
    if not config.rollout.seeded_sampling:
        return [None] * count
    return [SEED_BASE + index * config.rollout.sampling.n for index in range(count)]


# ----------------------------------------------------------------------------------------------
# Paths: each in its own process with its engine resident; the parent alternates their timed batches


READY, RUN, STOP = "ready", "run", "stop"


def raw_vllm_worker(config: AsyncRLConfig, prompts: list[list[int]], warmup: list[list[int]],
                    commands: multiprocessing.Queue, results: multiprocessing.Queue) -> None:
    """`LLM.generate` with vLLM's default outputs and with the server's: one batch of each per RUN."""
    from vllm import LLM, SamplingParams

    from rollout_servers.engine_args import SAMPLED_TOKEN_ONLY, engine_args, engine_process_env

    args = engine_args(config.model.path, config.rollout.engine, config.rollout.max_inflight)
    started = time.perf_counter()
    with engine_process_env(config.rollout.engine):
        llm = LLM(model=config.model.path, **{name: getattr(args, name) for name in SHARED_ENGINE_FIELDS})
    start_s = time.perf_counter() - started
    sampling = config.rollout.sampling
    shape = dict(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                 max_tokens=sampling.max_tokens, ignore_eos=True)
    plain = SamplingParams(**shape)

    def server_requests(count: int) -> list[SamplingParams]:
        return [SamplingParams(**shape, logprobs=SAMPLED_TOKEN_ONLY, flat_logprobs=True, detokenize=False, seed=seed)
                for seed in group_seeds(config, count)]

    clock = CpuClock()

    def generate(batch: list[list[int]], params: SamplingParams | list[SamplingParams]) -> Batch:
        began, (frontend, engine) = time.perf_counter(), clock.read()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        seconds, (frontend_end, engine_end) = time.perf_counter() - began, clock.read()
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return Batch(tokens, seconds, frontend_end - frontend, engine_end - engine)

    try:
        results.put((READY, start_s, generate(warmup, server_requests(len(warmup))).seconds))
        while commands.get() == RUN:
            results.put([asdict(generate(prompts, plain)), asdict(generate(prompts, server_requests(len(prompts))))])
    finally:
        llm.llm_engine.engine_core.shutdown()  # else the child waits on its engine process at exit


def server_worker(config: AsyncRLConfig, prompts: list[list[int]], warmup: list[list[int]],
                  commands: multiprocessing.Queue, results: multiprocessing.Queue) -> None:
    """`RolloutEngine.generate_group` for every prompt at once: one batch per RUN."""
    from rollout_servers.engine import RolloutEngine

    loop = asyncio.new_event_loop()  # AsyncLLM stays bound to the loop that started it
    started = time.perf_counter()
    engine = loop.run_until_complete(RolloutEngine.start(config.model.path, config.rollout))
    start_s = time.perf_counter() - started
    clock = CpuClock()

    async def generate(batch: list[list[int]]) -> Batch:
        began, (frontend, engine_cpu) = time.perf_counter(), clock.read()
        seeds = group_seeds(config, len(batch))
        groups = await asyncio.gather(*(engine.generate_group(ids, seed=seed) for ids, seed in zip(batch, seeds)))
        seconds, (frontend_end, engine_end) = time.perf_counter() - began, clock.read()
        tokens = sum(len(c.token_ids) for group in groups for c in group)
        return Batch(tokens, seconds, frontend_end - frontend, engine_end - engine_cpu)

    try:
        results.put((READY, start_s, loop.run_until_complete(generate(warmup)).seconds))
        while commands.get() == RUN:
            results.put([asdict(loop.run_until_complete(generate(prompts)))])
    finally:
        engine.shutdown()


class PathProcess:
    """One path's worker process: started (engine up, warmed) on creation, one timed round per `run`."""

    def __init__(self, worker, config: AsyncRLConfig, prompts: list[list[int]], warmup: list[list[int]]) -> None:
        self.commands, self.results = SPAWN.Queue(), SPAWN.Queue()
        self.child = SPAWN.Process(target=worker, args=(config, prompts, warmup, self.commands, self.results),
                                   name=worker.__name__)
        self.child.start()
        _, self.start_s, self.warmup_s = self._result()

    def run(self) -> list[Batch]:
        self.commands.put(RUN)
        return [Batch(**fields) for fields in self._result()]

    def _result(self):
        """The child's next result; a child that dies first (e.g. its engine refused the settings) ends
        the benchmark at once, pointing at its error above, instead of after PHASE_TIMEOUT_S."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return self.results.get(timeout=CHILD_POLL_S)
            except queue.Empty:
                if not self.child.is_alive():
                    raise SystemExit(f"{self.child.name} exited with code {self.child.exitcode} "
                                     "before reporting (its error is printed above)") from None
        raise SystemExit(f"{self.child.name} reported nothing within {PHASE_TIMEOUT_S}s")

    def stop(self) -> None:
        self.commands.put(STOP)
        self.child.join(EXIT_GRACE_S)
        if self.child.is_alive():
            self.child.terminate()


def measure(config: AsyncRLConfig, prompts: list[list[int]], warmup: list[list[int]], repeats: int) -> list[PhaseResult]:
    """Both engines resident at once (started one after the other); their timed batches alternate,
    the order flipping each round, so that both paths see the same load on a shared machine."""
    paths: list[PathProcess] = []
    try:
        paths.append(PathProcess(raw_vllm_worker, config, prompts, warmup))
        paths.append(PathProcess(server_worker, config, prompts, warmup))
        raw, server = paths
        rounds = []
        for index in range(repeats):
            order = (raw, server) if index % 2 == 0 else (server, raw)
            done = {id(path): path.run() for path in order}
            rounds.append(done[id(raw)] + done[id(server)])
    finally:
        for path in paths:
            path.stop()
    return [phase_result(name, [batches[column] for batches in rounds], path.start_s, path.warmup_s)
            for column, (name, path) in enumerate([(RAW, raw), (RAW_LOGPROBS, raw), (SERVER, server)])]


# ----------------------------------------------------------------------------------------------
# Report


def print_table(results: list[PhaseResult]) -> None:
    print(f"{'path':<34}{'tokens/batch':>13}{'best tok/s':>11}{'median tok/s':>13}{'front us/tok':>13}"
          f"{'engine us/tok':>14}{'start s':>9}{'warm-up s':>11}  batch seconds")
    for r in results:
        batches = " ".join(f"{s:.2f}" for s in r.seconds)
        print(f"{r.name:<34}{r.output_tokens:>13}{r.best_tokens_per_s:>11.0f}{r.median_tokens_per_s:>13.0f}"
              f"{r.cpu_us_per_token(r.frontend_cpu_s):>13.0f}{r.cpu_us_per_token(r.engine_cpu_s):>14.0f}"
              f"{r.start_s:>9.1f}{r.warmup_s:>11.1f}  {batches}")


def cpu_per_token(result: PhaseResult) -> float:
    """Least CPU microseconds per output token of one batch, generating process and engine together."""
    return 1e6 * min(f + e for f, e in zip(result.frontend_cpu_s, result.engine_cpu_s)) / result.output_tokens


def paired_ratio(numerator: PhaseResult, denominator: PhaseResult) -> tuple[float, float, float]:
    """Geometric mean of the per-round tokens/s ratios (the two batches of a round ran back to back, so
    they saw nearly the same load) and its ~95 % interval (± two standard errors of the log ratios)."""
    logs = [math.log((numerator.output_tokens / a) / (denominator.output_tokens / b))
            for a, b in zip(numerator.seconds, denominator.seconds)]
    mean = statistics.fmean(logs)
    spread = 2 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    return math.exp(mean), math.exp(mean - spread), math.exp(mean + spread)


def main() -> None:
    args = parse_args()
    config = load_settings(args)
    ensure_model(config)
    prompts = workload_prompts(config, args.num_prompts)
    warmup = prompts[:WARMUP_PROMPTS]
    raw, raw_logprobs, server = measure(config, prompts, warmup, args.repeats)
    sampling = config.rollout.sampling
    print(f"{args.num_prompts} prompts x {sampling.n} samples x {sampling.max_tokens} output tokens, "
          f"max_inflight {config.rollout.max_inflight}, seeded {config.rollout.seeded_sampling}, model {config.model.path}, "
          f"{os.cpu_count()} CPUs visible, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print_table([raw, raw_logprobs, server])
    for label, baseline in (("raw vLLM", raw), ("raw vLLM with the server's requests", raw_logprobs)):
        mean, low, high = paired_ratio(server, baseline)
        print(f"server / {label}, per round: {mean:.3f} (~95 % interval {low:.3f}-{high:.3f})")
    print("RESULT " + json.dumps({
        "server_tok_s": round(server.best_tokens_per_s, 1),
        "raw_vllm_tok_s": round(raw.best_tokens_per_s, 1),
        "ratio": round(server.best_tokens_per_s / raw.best_tokens_per_s, 3),
        "server_tok_s_median": round(server.median_tokens_per_s, 1),
        "raw_vllm_tok_s_median": round(raw.median_tokens_per_s, 1),
        "ratio_median": round(server.median_tokens_per_s / raw.median_tokens_per_s, 3),
        "raw_vllm_same_outputs_tok_s": round(raw_logprobs.best_tokens_per_s, 1),
        "ratio_same_outputs": round(server.best_tokens_per_s / raw_logprobs.best_tokens_per_s, 3),
        "ratio_paired": [round(x, 3) for x in paired_ratio(server, raw)],
        "ratio_same_outputs_paired": [round(x, 3) for x in paired_ratio(server, raw_logprobs)],
        "server_cpu_us_per_token": round(cpu_per_token(server), 1),
        "raw_vllm_cpu_us_per_token": round(cpu_per_token(raw), 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "repeats": args.repeats,
        "num_prompts": args.num_prompts,
        "n": sampling.n,
        "max_tokens": sampling.max_tokens,
        "max_inflight": config.rollout.max_inflight,
        "seeded_sampling": config.rollout.seeded_sampling,
        "server_output_tokens_per_batch": server.output_tokens,
        "raw_output_tokens_per_batch": raw.output_tokens,
    }))


if __name__ == "__main__":
    main()
