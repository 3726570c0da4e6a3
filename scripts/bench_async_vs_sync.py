"""End-to-end trained tokens/s of asyncrl's asynchronous mode against its synchronous mode, same machine, same job.

The async mode runs the product's two commands, as a user would in two terminals:
  `asyncrl learner` (GPU 1 on a two-GPU host) and `asyncrl rollout --num-servers 1` (GPU 0); on a larger host
  --servers S and --learner-ranks L place S servers on GPUs 0..S-1 and L learner ranks on the next L GPUs
  (`rollout.gpus` / `learner.gpus`, counted within CUDA_VISIBLE_DEVICES); with --colocated, one server and one learner rank share GPU 0
  (`learner.gpus=[0] rollout.gpus=[0]`: weights through CUDA IPC, the servers' memory share lowered to leave
  the learner room, as docs/placement.md says); with --mixed, the async mode's --servers servers take GPUs 0..S-1
  and its one learner rank runs beside the last of them (a mixed plan: that server receives by CUDA IPC, the
  others by NCCL) while the sync mode keeps its two GPUs,
for --steps optimizer steps, training while the server generates (K=--max-staleness). The sync mode is
`asyncrl learner learner.mode=synchronous`, the synchronous reference (launch/reference_loop.py): one process with
its own engine generates a batch, trains one step on it and loads the new weights, then the next batch.
Response lengths are long-tailed, in one of two ways (--lengths):
  per-prompt  each prompt carries its own cap (`extra_info.max_tokens`, see docs/configuration.md) drawn
              from a log-normal distribution, and EOS is ignored so every sample runs to its cap: a
              group's samples are equally long
  per-sample  each sample draws its own length, as EOS-driven lengths vary inside a group in real RL: a set
              of stop token ids (`rollout.sampling.stop_token_ids`) that a randomly initialised model,
              whose next-token distribution is near uniform, samples with probability 1 - 2^(-1/median)
              per token, so lengths are geometric with that median, capped at max_tokens (random weights only)
The rates are counted from the learner's metrics after --warmup-steps steps (an async run: at least K + 1, see
Run.warmup), up to the step before the last (which also writes the final checkpoint). The headline is trained
response tokens/s with the mean trained response length beside it: samples/s alone flatters a run that trains
shorter responses than the policy generates (a length bias), and the length ratio against sync (whose trained
responses are all it generated) and the async run's own trained/generated mean length
(`response_length/trained_vs_generated`) say whether it does. Samples/s comes second; over the same steps, the
groups the buffer dropped (those that started outside the staleness bound: 0 in a normal run) and the share of
the learner's time spent waiting for a batch.
--max-staleness takes a list (e.g. 1,2,4,8) to sweep K: the async mode runs once per K (run directory
bench-async-k<K>), each compared with the one sync run, so staleness can be tuned against throughput.
--modes runs a subset; with a fixed --out-dir, a run made earlier is read back from its metrics, so the
runs can be made in separate calls (each under a host's per-command time limit) and still be compared;
--modes '' runs nothing and reports what --out-dir holds.
Last line: RESULT {json} with, for the first K listed, trained_tokens_speedup (async / sync trained response
tokens/s), length_ratio (async / sync mean trained response length), trained_vs_generated (the async run's own),
async_trained_tokens_per_s, sync_trained_tokens_per_s, then async_samples_per_s, sync_samples_per_s,
async_vs_sync_speedup (in samples/s), the staleness the async run trained with and its servers' median pause per
weight sync (server_pause_ms); and `sweep` with every K's figures (once the async runs have run; the figures
against sync are null until the sync run is there too);
--colocated adds colocated_async_vs_sync and colocated_weight_sync_ms (the same figures, named as such), --mixed
mixed_async_vs_sync and mixed_weight_sync_ms.
With --ray-address the async mode is `asyncrl launch` on that Ray cluster instead of the two commands: the same
servers and learner ranks, one GPU per rank and --tensor-parallel per server, but Ray picks the GPUs
(`ray.learner.num_gpus`, `ray.rollout.num_gpus`); the sync mode is the same reference as without it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.config_arguments import add_config_arguments
from asyncrl.data import load_prompt_file
from asyncrl.gpu_ids import visible_gpus

JOB_TIMEOUT_S = 900  # one mode's learner run, engine start included
STOP_TIMEOUT_S = 60  # the rollout command gets this long to stop after SIGTERM
MODES = ("sync", "async")
LEARNER_MODE = {"sync": "synchronous", "async": "async"}  # each mode's learner.mode
SIMULATED_SAMPLES = 100_000  # draws behind the reported length stats of --lengths per-sample


@dataclass(frozen=True)
class Run:
    """One learner + rollout run of the benchmark."""
    mode: str  # learner.mode
    k: int  # buffer.max_staleness

    @property
    def name(self) -> str:
        """Its run directory under --out-dir."""
        return "bench-sync" if self.mode == "sync" else f"bench-async-k{self.k}"

    @property
    def label(self) -> str:
        return "sync" if self.mode == "sync" else f"async K={self.k}"

    def warmup(self, warmup_steps: int) -> int:
        """Steps left out of its rate. While the learner's first step runs (compiling: 14 s on an H100) an async
        server fills the buffer up to K + 1 batches ahead, and the next K steps drain that backlog without
        waiting: timed, they would credit the async run with throughput it has not sustained."""
        return warmup_steps if self.mode == "sync" else max(warmup_steps, self.k + 1)


MIN_TIMED_STEPS = 2  # fewer give no rate worth printing


def planned_runs(ks: list[int]) -> list[Run]:
    """The sync run, then one async run per K (sync mode never reads stale data, so one K serves it)."""
    return [Run("sync", ks[0]), *(Run("async", k) for k in ks)]


def k_list(text: str) -> list[int]:
    ks = [int(k) for k in text.split(",")]
    if not ks or min(ks) < 0 or len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of distinct staleness bounds >= 0")
    return ks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "configs/gpu_qwen05b.yaml", "config overrides for every mode")
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per mode")
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the rate")
    parser.add_argument("--max-staleness", type=k_list, default=[2],
                        help="K of the async run; a comma-separated list runs one async run per K")
    parser.add_argument("--median-tokens", type=int, default=192, help="median response length")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of response lengths (tail weight)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the length draw")
    parser.add_argument("--lengths", choices=("per-prompt", "per-sample"), default="per-prompt",
                        help="long-tailed lengths per prompt (log-normal caps) or per sample (geometric, stop ids)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run now ('' = none, only report)")
    parser.add_argument("--colocated", action="store_true", help="learner and server share GPU 0 (a one-GPU job)")
    parser.add_argument("--mixed", action="store_true",
                        help="async: a server on each of GPUs 0..S-1, the learner beside the last one (one rank)")
    parser.add_argument("--servers", type=int, default=1,
                        help="rollout servers, --tensor-parallel GPUs each (GPUs 0..S·TP-1)")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="GPUs per rollout server (sets rollout.engine.tensor_parallel_size)")
    parser.add_argument("--learner-ranks", type=int, default=1, help="learner ranks, one GPU each (after the servers')")
    parser.add_argument("--ray-address", default="",
                        help="run the async mode with `asyncrl launch` on this Ray cluster (e.g. auto), not the two commands")
    parser.add_argument("--out-dir", default="",
                        help="where every mode's run directory goes; runs already there are read back "
                             "(default: a new temporary one)")
    return parser.parse_args()


def long_tailed_prompts(args: argparse.Namespace, max_tokens: int, source: str, target: Path) -> dict:
    """The config's training prompts, each with a log-normal response-length cap; returns length stats."""
    rng = random.Random(args.seed)
    rows, lengths = [], []
    for row in load_prompt_file(source):
        length = min(max_tokens, max(1, round(rng.lognormvariate(math.log(args.median_tokens), args.sigma))))
        lengths.append(length)
        rows.append({"prompt": row.messages, "data_source": row.data_source, "ability": row.ability,
                     "reward_model": {"ground_truth": row.ground_truth, "style": row.reward_style},
                     "extra_info": {**row.extra_info, "max_tokens": length}})
    target.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return _length_stats(lengths)


def stop_token_ids(vocab_size: int, median_tokens: int, seed: int) -> list[int]:
    """Token ids a near-uniform next-token distribution samples with probability 1 - 2^(-1/median) per
    token: lengths are then geometric with the given median."""
    per_token = 1 - 2 ** (-1 / median_tokens)
    return sorted(random.Random(seed).sample(range(vocab_size), max(1, round(vocab_size * per_token))))


def geometric_lengths(median_tokens: int, max_tokens: int, samples: int, seed: int) -> dict:
    """Length stats of `samples` geometric draws with that median, capped at max_tokens (what per-sample gives)."""
    rng, per_token = random.Random(seed), 1 - 2 ** (-1 / median_tokens)
    lengths = [min(max_tokens, 1 + int(math.log(1 - rng.random()) / math.log(1 - per_token))) for _ in range(samples)]
    return _length_stats(lengths)


def _length_stats(lengths: list[int]) -> dict:
    ordered = sorted(lengths)
    return {"mean": sum(lengths) / len(lengths), "p50": ordered[len(ordered) // 2],
            "p99": ordered[int(len(ordered) * 0.99)], "max": ordered[-1]}


def run_mode(run: Run, args: argparse.Namespace, root: Path, data_file: Path) -> None:
    """Run the mode once (a previous run of the same name in `root` is replaced, not resumed)."""
    shutil.rmtree(root / run.name, ignore_errors=True)
    overrides = [f"run.root_dir={root}", f"run.name={run.name}", f"learner.mode={LEARNER_MODE[run.mode]}",
                 f"learner.total_steps={args.steps}", f"buffer.max_staleness={run.k}",
                 f"data.train_files=[{data_file}]", "rollout.sampling.ignore_eos=true", *args.overrides]
    command = [sys.executable, "-m", "launch"]
    on_ray = bool(args.ray_address) and run.mode == "async"
    if on_ray:  # one command places every role on the cluster
        learner = subprocess.Popen([*command, "launch", "--config", args.config, "--ray-address", args.ray_address,
                                    *overrides, *ray_layout(args)])
    else:
        learner = subprocess.Popen([*command, "learner", "--config", args.config, *overrides, *gpu_layout(args, run.mode)])
    # the sync mode's learner owns its engine; the async mode's learner needs the rollout command
    rollout = None if run.mode == "sync" or on_ray else subprocess.Popen(
        [*command, "rollout", "--config", args.config, *overrides, *gpu_layout(args, run.mode)], start_new_session=True)
    try:
        learner.wait(JOB_TIMEOUT_S)
    finally:
        if rollout is not None:
            _stop(rollout)
        if learner.poll() is None:
            learner.kill()
    if learner.returncode != 0:
        raise SystemExit(f"{run.label}: {'asyncrl launch' if on_ray else 'the learner'} exited with {learner.returncode}")


def _metrics_file(root: Path, run: Run) -> Path:
    return root / run.name / "metrics.jsonl"


def _metrics(root: Path, run: Run) -> list[dict]:
    return [json.loads(line) for line in _metrics_file(root, run).read_text().splitlines()]


def gpu_layout(args: argparse.Namespace, mode: str = "async") -> list[str]:
    """The roles' GPUs as the commands' overrides (each command pins itself to its list); none without GPUs. The
    synchronous reference runs one engine and one learner rank: the first two visible GPUs (or the first for both,
    colocated). The lists name physical ids, as the commands read them, whatever CUDA_VISIBLE_DEVICES lets us see."""
    visible = visible_gpus()
    if not visible:
        return []
    if args.colocated:
        return [f"learner.gpus=[{visible[0]}]", f"rollout.gpus=[{visible[0]}]"]
    server_count, rank_count = (1, 1) if mode == "sync" else (args.servers, args.learner_ranks)
    server_gpus = server_count * args.tensor_parallel
    servers, ranks = list(range(server_gpus)), list(range(server_gpus, server_gpus + rank_count))
    if args.mixed and mode != "sync":  # one learner rank, beside the last server
        ranks = servers[-1:]
    needed = len(set(servers) | set(ranks))
    if needed > len(visible):
        raise SystemExit(f"--servers {args.servers} --tensor-parallel {args.tensor_parallel} --learner-ranks "
                         f"{args.learner_ranks} need {needed} GPUs; {len(visible)} are visible")
    return [f"rollout.num_servers={server_count}", f"learner.nproc={rank_count}",
            f"rollout.engine.tensor_parallel_size={args.tensor_parallel}",
            f"rollout.gpus=[{','.join(str(visible[i]) for i in servers)}]",
            f"learner.gpus=[{','.join(str(visible[i]) for i in ranks)}]"]


def ray_layout(args: argparse.Namespace) -> list[str]:
    """The async layout under `asyncrl launch`: as many servers and ranks as `gpu_layout`, GPUs picked by Ray."""
    gpus_per_role = 1 if visible_gpus() else 0
    return [f"rollout.num_servers={args.servers}", f"learner.nproc={args.learner_ranks}",
            f"rollout.engine.tensor_parallel_size={args.tensor_parallel}",
            f"ray.learner.num_gpus={gpus_per_role}", f"ray.rollout.num_gpus={gpus_per_role * args.tensor_parallel}"]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the rollout command (it stops its servers); its whole process group is killed if it hangs."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def summarise(records: list[dict], warmup_steps: int) -> dict:
    """Trained response tokens/s and samples/s from the end of the warm-up steps to the step before the last
    (the last one also pays for the final checkpoint), plus staleness, response lengths (and, for an async run,
    its trained/generated mean length at the last timed step), the groups dropped and the learner's waiting
    over the same steps. Trained tokens/s leads: a run that trains shorter responses than the policy generates
    shows more samples/s than it earns."""
    steps = [r for r in records if "batch/samples" in r]
    timed = [r for r in steps if warmup_steps < r["step"] < steps[-1]["step"]]
    start = next(r for r in steps if r["step"] == warmup_steps)
    seconds = timed[-1]["time"] - start["time"]
    samples = sum(r["batch/samples"] for r in timed)

    def counted(key: str) -> int:  # a cumulative buffer counter's growth over the timed steps
        return int(timed[-1].get(key, 0) - start.get(key, 0))

    return {
        "samples_per_s": samples / seconds, "step_s": seconds / len(timed), "steps": len(timed),
        "trained_tokens_per_s": sum(r["batch/samples"] * r.get("response_length/mean", 0.0) for r in timed) / seconds,
        "trained_vs_generated": timed[-1].get("response_length/trained_vs_generated"),
        "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in timed) / len(timed),
        "staleness_max": int(max(r.get("staleness/max", 0) for r in timed)),
        "response_length_mean": sum(r.get("response_length/mean", 0.0) for r in timed) / len(timed),
        "groups_handed_out": counted("buffer/handed_out"),
        "groups_dropped_stale": counted("buffer/dropped_stale"),
        "learner_wait_share": sum(r.get("timing_s/wait_batch", 0.0) for r in timed) / seconds,
        "server_pause_ms": _median([r["weight_sync/server_pause_seconds"] * 1000 for r in timed
                                    if r.get("weight_sync/server_pause_seconds")]),
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else math.nan


def print_table(results: dict[Run, dict], baseline: dict | None) -> None:
    """One row per run, trained tokens first; ratios against the sync run where it has run."""
    print(f"{'run':10} {'trained tok/s':>13} {'vs sync':>8} {'resp len':>9} {'vs sync':>8} {'trained/gen':>11} "
          f"{'samples/s':>10} {'vs sync':>8} {'step s':>7} {'staleness mean':>15} {'max':>4} {'dropped':>8} "
          f"{'learner waits':>14} {'sync pause ms':>14}")
    for run, r in results.items():
        dropped = f"{r['groups_dropped_stale']}/{r['groups_dropped_stale'] + r['groups_handed_out']}"
        own = f"{r['trained_vs_generated']:11.3f}" if r["trained_vs_generated"] is not None else f"{'-':>11}"
        print(f"{run.label:10} {r['trained_tokens_per_s']:13.0f} {_times(r, baseline, 'trained_tokens_per_s')} "
              f"{r['response_length_mean']:9.1f} {_times(r, baseline, 'response_length_mean')} {own} "
              f"{r['samples_per_s']:10.2f} {_times(r, baseline, 'samples_per_s')} {r['step_s']:7.2f} "
              f"{r['staleness_mean']:15.2f} {r['staleness_max']:4d} {dropped:>8} {r['learner_wait_share']:13.0%} "
              f"{r['server_pause_ms']:14.1f}")
    print("trained/gen = the run's mean trained response length / its servers' mean generated one (1 = no length "
          "bias; sync trains all it generates); dropped = groups dropped for a start outside the bound / groups "
          "that reached the learner's reads, over the timed steps")


def _times(result: dict, baseline: dict | None, key: str) -> str:
    """result[key] / baseline[key] as a column of the table ('-' without the baseline)."""
    return f"{result[key] / baseline[key]:7.2f}x" if baseline else f"{'-':>8}"


def against(value: float, reference: float | None) -> float | None:
    """value / reference to 3 decimals, or None while the reference run is missing."""
    return round(value / reference, 3) if reference else None


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def sweep_entry(run: Run, result: dict, sync: dict | None) -> dict:
    return {
        "k": run.k, "trained_tokens_per_s": round(result["trained_tokens_per_s"], 1),
        "trained_tokens_speedup": against(result["trained_tokens_per_s"], sync and sync["trained_tokens_per_s"]),
        "length_ratio": against(result["response_length_mean"], sync and sync["response_length_mean"]),
        "trained_vs_generated": _rounded(result["trained_vs_generated"]),
        "samples_per_s": round(result["samples_per_s"], 2),
        "speedup": against(result["samples_per_s"], sync and sync["samples_per_s"]),
        "staleness_mean": round(result["staleness_mean"], 3), "staleness_max": result["staleness_max"],
        "response_length_mean": round(result["response_length_mean"], 1),
        "groups_dropped_stale": result["groups_dropped_stale"], "groups_handed_out": result["groups_handed_out"],
        "learner_wait_share": round(result["learner_wait_share"], 3), "timed_steps": result["steps"],
    }


def main() -> None:
    args = parse_args()
    config = load_config(args.config, args.overrides)
    root = Path(args.out_dir or tempfile.mkdtemp(prefix="asyncrl-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    data_file = root / "train_longtail.jsonl"
    max_tokens = config.rollout.sampling.max_tokens
    if args.lengths == "per-sample":
        vocab_size = json.loads((Path(config.model.path) / "config.json").read_text())["vocab_size"]
        stops = stop_token_ids(vocab_size, args.median_tokens, args.seed)
        args.overrides.append(f"rollout.sampling.stop_token_ids=[{','.join(map(str, stops))}]")
        data_file = Path(config.data.train_files[0])
        lengths = geometric_lengths(args.median_tokens, max_tokens, SIMULATED_SAMPLES, args.seed)
    else:
        lengths = long_tailed_prompts(args, max_tokens, config.data.train_files[0], data_file)
    print(f"response lengths: {lengths}")
    modes = [mode for mode in args.modes.split(",") if mode]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown mode(s) {sorted(unknown)} (choose from {', '.join(MODES)})")
    runs = planned_runs(args.max_staleness)
    if short := [run.label for run in runs if args.steps - 1 - run.warmup(args.warmup_steps) < MIN_TIMED_STEPS]:
        raise SystemExit(f"--steps {args.steps} leaves fewer than {MIN_TIMED_STEPS} timed steps for {', '.join(short)} "
                         f"(an async run's warm-up is at least K + 1 steps, and the last step is not timed)")
    for run in runs:
        if run.mode in modes:
            run_mode(run, args, root, data_file)
    results = {run: summarise(_metrics(root, run), run.warmup(args.warmup_steps))
               for run in runs if _metrics_file(root, run).exists()}
    sync = results.get(runs[0])
    print_table(results, sync)
    if len(results) != len(runs):
        print(f"make the remaining runs (--modes) with --out-dir {root} to compare them")
    if any(run not in results for run in runs[1:]):
        return  # the RESULT needs every async run; the sync run only for the ratios
    sweep = [sweep_entry(run, results[run], sync) for run in runs[1:]]
    first = sweep[0]  # the headline figures: the first K listed
    if sync:
        print(f"async K={first['k']} / sync: {first['trained_tokens_speedup']:.2f}x in trained response tokens/s, "
              f"trained responses {first['length_ratio']:.2f}x as long as sync's; {first['speedup']:.2f}x in samples/s")
    result = {
        "trained_tokens_speedup": first["trained_tokens_speedup"],
        "length_ratio": first["length_ratio"],
        "trained_vs_generated": first["trained_vs_generated"],
        "async_trained_tokens_per_s": first["trained_tokens_per_s"],
        "sync_trained_tokens_per_s": sync and round(sync["trained_tokens_per_s"], 1),
        "async_samples_per_s": first["samples_per_s"],
        "sync_samples_per_s": sync and round(sync["samples_per_s"], 2),
        "async_vs_sync_speedup": first["speedup"],
        "async_response_length_mean": first["response_length_mean"],
        "sync_response_length_mean": sync and round(sync["response_length_mean"], 1),
        "staleness_mean": first["staleness_mean"],
        "staleness_max": first["staleness_max"],
        "lengths": args.lengths, "response_lengths": lengths, "steps": args.steps, "warmup_steps": args.warmup_steps,
        "max_staleness": first["k"],
        "sweep": sweep,
        "server_pause_ms": round(results[runs[1]]["server_pause_ms"], 1),
    }
    if args.colocated:
        result |= {"colocated_async_vs_sync": result["async_vs_sync_speedup"],
                   "colocated_weight_sync_ms": result["server_pause_ms"]}
    if args.mixed:
        result |= {"mixed_async_vs_sync": result["async_vs_sync_speedup"], "mixed_weight_sync_ms": result["server_pause_ms"]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
