"""Engines per GPU: the generation side kept full with one engine, then with several sharing the GPU, side by side.

vLLM's engine core (scheduler, model runner, output path) is one process on one CPU core; with a small model its
steps can keep that core busy while the GPU idles, and then several engines on the one GPU, each its own engine core
and front end, generate more than one does. For each count of --engines, `scripts/engine_ceiling.py` keeps that many
engines full at once on the job's task (rollout.num_servers of them, the config's rollout.max_inflight split among
them and CUDA graphs no larger than one engine's part, as `bench_time_to_score.py --async-servers` runs the async
job; their memory share split too), one count after the other on the GPUs this process sees. Columns:
  engines      engines kept full at once, each in a process of its own (1: one, in the measure's process)
  in flight    samples each engine runs at once
  tokens/s     output tokens a second of all of them (finished and partial samples: engine_ceiling.py)
  each         each engine's own tokens/s
  length       mean length of the samples that finished in the window
  start (s)    the slowest engine's start
  vs first     tokens/s against the first count's
Last line: RESULT {json} with every count's figures and `speedups` (against the first count).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from asyncrl.config import AsyncRLConfig, load_config
from asyncrl.config_arguments import add_config_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, only scripts/ is on the path
from scripts.race_runs import servers_overrides  # noqa: E402
from scripts.child_result import result_of  # noqa: E402
from scripts.race_figures import ratio  # noqa: E402

CEILING_SCRIPT = Path(__file__).with_name("engine_ceiling.py")
COUNT_TIMEOUT_S = 1800  # one count's engines: their starts, one after the other, and the window


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "configs/gpu_longtail.yaml", "config overrides every count shares")
    parser.add_argument("--engines", default="1,2", help="counts of engines to keep full, comma-separated, in order")
    parser.add_argument("--warmup-s", type=float, default=15.0, help="seconds generated before each window opens")
    parser.add_argument("--seconds", type=float, default=30.0, help="each count's timed window")
    args = parser.parse_intermixed_args(argv)
    counts = [int(count) for count in args.engines.split(",") if count]
    if not counts or min(counts) < 1:
        parser.error(f"--engines {args.engines!r}: counts of engines, each at least 1")
    args.counts = counts
    return args


def count_command(args: argparse.Namespace, overrides: tuple[str, ...]) -> list[str]:
    """engine_ceiling.py on the config and shared overrides, then one count's own (`overrides`)."""
    return [sys.executable, str(CEILING_SCRIPT), "--config", args.config, "--warmup-s", str(args.warmup_s),
            "--seconds", str(args.seconds), *args.overrides, *overrides]


def measure(args: argparse.Namespace, config: AsyncRLConfig, count: int) -> dict[str, Any]:
    """`count` engines kept full at once on `config` (engine_ceiling.py's figures, its table shown, its RESULT read)."""
    result = result_of(count_command(args, servers_overrides(config, count)), f"{count} engine(s)", COUNT_TIMEOUT_S)
    return result | {"engines": count, "in_flight_each": result["max_inflight"] // count,
                     "engine_tokens_per_s": result.get("engine_tokens_per_s", [result["ceiling_tokens_per_s"]])}


def print_table(results: list[dict[str, Any]], speedups: list[float | None]) -> None:
    print(f"{'engines':>8}{'in flight':>11}{'tokens/s':>11}  {'each':<24}{'length':>8}{'start (s)':>11}{'vs first':>10}")
    for result, speedup in zip(results, speedups):
        each = ", ".join(f"{rate:.0f}" for rate in result["engine_tokens_per_s"])
        vs_first = "-" if speedup is None else f"{speedup:.2f}x"
        print(f"{result['engines']:>8}{result['in_flight_each']:>11}{result['ceiling_tokens_per_s']:>11.0f}  "
              f"{each:<24}{result['length_mean'] or '-'!s:>8}{result['engine_start_s']:>11}{vs_first:>10}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    results = [measure(args, config, count) for count in args.counts]
    first = results[0]["ceiling_tokens_per_s"]
    speedups = [ratio(result["ceiling_tokens_per_s"], first) for result in results]
    print_table(results, speedups)
    print("RESULT " + json.dumps({"counts": args.counts, "tokens_per_s": [r["ceiling_tokens_per_s"] for r in results],
                                  "speedups": speedups, "runs": results}), flush=True)


if __name__ == "__main__":
    main()
