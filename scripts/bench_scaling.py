"""End-to-end throughput as GPUs are added: the GPU preset's job, async and sync, at several GPU layouts.

Each layout is `scripts/bench_async_vs_sync.py` with --servers S --learner-ranks L (S rollout servers on GPUs
0..S-1, L FSDP learner ranks on the next L GPUs; `colocated` = one GPU shared by both roles, weights through
CUDA IPC), run in its own directory under --out-dir, with the same job, lengths, steps and K. The sync
column is the synchronous reference (`learner.mode=synchronous`: one engine and one learner rank, on GPUs 0 and 1
whatever the layout), so async / sync says what the layout's GPUs buy over the reference. The first
layout listed is the baseline of the scaling column (2 GPUs: one server, one learner rank, by default).
A host's per-command time limit rarely holds every run: --modes and --layouts pick what runs now, runs already
in --out-dir are read back, and --modes '' only reports. Table: per layout, trained response tokens/s first
(async, sync, async / sync, against the first layout's async), the async mean trained response length against
sync's and against its own servers' mean generated one (a run that trains shorter responses than the policy
generates earns less than its samples/s say), then samples/s (async, sync, async / sync), the staleness trained,
the learner's share of time waiting for a batch, and the servers' median pause per weight sync.
A layout ending in `@ray` (e.g. 3:1@ray) runs its async mode with `asyncrl launch` on the Ray cluster of
--ray-address (bench_async_vs_sync.py --ray-address): the same servers and ranks, GPUs picked by Ray.
Last line: RESULT {json} with, per layout, `gpus`, `trained_tokens_speedup` (async / sync trained response
tokens/s), `length_ratio` (async / sync mean trained response length), `trained_vs_generated` (the async run's
own), `async_trained_tokens_per_s`, `trained_tokens_scaling_vs_2gpu` (async trained tokens/s / the first
layout's), then in samples/s `scaling_vs_2gpu`, `async_vs_sync` and `async_samples_per_s` (ratios null where the
sync run is missing), and `ray_vs_plain` (a Ray layout's async samples/s / the same layout's without Ray, where
both ran), once the first layout's async run is there.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config_arguments import add_config_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, only scripts/ is on the path
from scripts.child_result import RESULT_PREFIX, result_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RAY_SUFFIX = "@ray"


@dataclass(frozen=True)
class Layout:
    servers: int  # rollout servers, one GPU each
    learner_ranks: int  # learner ranks, one GPU each
    colocated: bool = False  # one GPU for one server and one learner rank
    ray: bool = False  # the async mode runs under `asyncrl launch` on a Ray cluster

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'S:L' (S servers, L learner ranks) or 'colocated'; 'S:L@ray' for the same under Ray."""
        shape, ray = (text[:-len(RAY_SUFFIX)], True) if text.endswith(RAY_SUFFIX) else (text, False)
        if shape == "colocated" and not ray:
            return cls(1, 1, colocated=True)
        try:
            servers, ranks = (int(part) for part in shape.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a layout is SERVERS:LEARNER_RANKS (e.g. 3:1), SERVERS:LEARNER_RANKS@ray "
                                             f"or 'colocated', got '{text}'")
        if servers < 1 or ranks < 1:
            raise argparse.ArgumentTypeError(f"layout '{text}': at least one server and one learner rank")
        return cls(servers, ranks, ray=ray)

    @property
    def gpus(self) -> int:
        return 1 if self.colocated else self.servers + self.learner_ranks

    @property
    def name(self) -> str:
        return "colocated" if self.colocated else f"{self.servers}s{self.learner_ranks}l" + ("-ray" if self.ray else "")

    @property
    def without_ray(self) -> Layout:
        return Layout(self.servers, self.learner_ranks, self.colocated)

    def arguments(self, ray_address: str) -> list[str]:
        if self.colocated:
            return ["--colocated"]
        return ["--servers", str(self.servers), "--learner-ranks", str(self.learner_ranks),
                *(["--ray-address", ray_address] if self.ray else [])]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="1:1,3:1",
                        help="comma-separated SERVERS:LEARNER_RANKS, SERVERS:LEARNER_RANKS@ray or 'colocated'; the first "
                             "is the scaling baseline")
    parser.add_argument("--ray-address", default="auto", help="the Ray cluster of the @ray layouts")
    parser.add_argument("--run-layouts", default="",
                        help="the layouts to run now (default: all of --layouts); the others are only read back")
    parser.add_argument("--modes", default="sync,async", help="modes to run now ('' = none, only report)")
    parser.add_argument("--out-dir", default="/tmp/asyncrl-scaling", help="one directory per layout under it")
    add_config_arguments(parser, "configs/gpu_qwen05b.yaml", "config overrides for every run")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the rate")
    parser.add_argument("--max-staleness", type=int, default=2, help="K of the async runs")
    return parser.parse_args()


def bench(layout: Layout, args: argparse.Namespace, modes: str) -> dict | None:
    """Run (or only read back, with modes '') one layout; its RESULT, or None while its async run is missing."""
    command = [sys.executable, str(ROOT / "scripts" / "bench_async_vs_sync.py"), "--config", args.config,
               "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
               "--max-staleness", str(args.max_staleness), "--modes", modes,
               "--out-dir", str(Path(args.out_dir) / layout.name), *layout.arguments(args.ray_address), *args.overrides]
    print(f"=== {layout.name} ({layout.gpus} GPU{'s' if layout.gpus > 1 else ''}): modes '{modes}'", flush=True)
    return result_of(command, layout.name, show_result=True)


def print_table(results: dict[Layout, dict], baseline: dict | None) -> None:
    print(f"{'layout':10} {'GPUs':>4} {'async tok/s':>11} {'sync tok/s':>10} {'async/sync':>10} {'vs first':>8} "
          f"{'len vs sync':>11} {'trained/gen':>11} {'async/s':>8} {'sync/s':>8} {'async/sync':>10} "
          f"{'staleness':>9} {'learner waits':>13} {'sync pause ms':>13}")
    for layout, r in results.items():
        scaling = (f"{r['async_trained_tokens_per_s'] / baseline['async_trained_tokens_per_s']:7.2f}x" if baseline
                   else f"{'-':>8}")
        wait = r["sweep"][0]["learner_wait_share"]
        print(f"{layout.name:10} {layout.gpus:4d} {r['async_trained_tokens_per_s']:11.0f} "
              f"{_cell(r['sync_trained_tokens_per_s'], 10, '.0f')} {_cell(r['trained_tokens_speedup'], 9, '.2f', 'x')} "
              f"{scaling} {_cell(r['length_ratio'], 10, '.2f', 'x')} {_cell(r['trained_vs_generated'], 11, '.3f')} "
              f"{r['async_samples_per_s']:8.2f} {_cell(r['sync_samples_per_s'], 8, '.2f')} "
              f"{_cell(r['async_vs_sync_speedup'], 9, '.2f', 'x')} {r['staleness_mean']:9.2f} {wait:12.0%} "
              f"{r['server_pause_ms']:13.1f}")


def _cell(value: float | None, width: int, spec: str, unit: str = "") -> str:
    """`value` right-aligned in `width` characters (then `unit`), or '-' over the whole cell when it is missing."""
    return f"{value:{width}{spec}}{unit}" if value is not None else f"{'-':>{width + len(unit)}}"


def main() -> None:
    args = parse_args()
    layouts = [Layout.parse(text) for text in args.layouts.split(",") if text]
    now = {Layout.parse(text) for text in args.run_layouts.split(",") if text} or set(layouts)
    results = {}
    for layout in layouts:
        result = bench(layout, args, args.modes if layout in now else "")
        if result is not None:
            results[layout] = result
    baseline = results.get(layouts[0])
    print_table(results, baseline)
    if baseline is None:
        print(f"the first layout ({layouts[0].name}) has no async run yet: no scaling column")
        return
    print(RESULT_PREFIX + json.dumps({
        "gpus": {layout.name: layout.gpus for layout in results},
        "trained_tokens_speedup": {layout.name: r["trained_tokens_speedup"] for layout, r in results.items()},
        "length_ratio": {layout.name: r["length_ratio"] for layout, r in results.items()},
        "trained_vs_generated": {layout.name: r["trained_vs_generated"] for layout, r in results.items()},
        "async_trained_tokens_per_s": {layout.name: r["async_trained_tokens_per_s"] for layout, r in results.items()},
        "trained_tokens_scaling_vs_2gpu": {
            layout.name: round(r["async_trained_tokens_per_s"] / baseline["async_trained_tokens_per_s"], 3)
            for layout, r in results.items()},
        "scaling_vs_2gpu": {layout.name: round(r["async_samples_per_s"] / baseline["async_samples_per_s"], 3)
                            for layout, r in results.items()},
        "async_vs_sync": {layout.name: r["async_vs_sync_speedup"] for layout, r in results.items()},
        "async_samples_per_s": {layout.name: r["async_samples_per_s"] for layout, r in results.items()},
        "ray_vs_plain": {layout.name: round(r["async_samples_per_s"] / results[layout.without_ray]["async_samples_per_s"], 3)
                         for layout, r in results.items() if layout.ray and layout.without_ray in results},
        "baseline": layouts[0].name, "steps": args.steps, "max_staleness": args.max_staleness,
    }), flush=True)


if __name__ == "__main__":
    main()
