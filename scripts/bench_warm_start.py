"""The warm start's seconds a step, variant against variant, on this machine's device.

`asyncrl init-model` warm-starts the tiny-family model with supervised steps (model.warm_start); the race's ~600 M
shape takes 400 of them, ~300 s of a GPU session. Each variant is a set of config overrides (the warm start's
deterministic kernels and micro-batches, say) on top of the config and the overrides every variant shares. Each runs
in a process of its own (cuBLAS reads its workspace setting once per process): the model is built from run.seed,
trained --warmup-steps supervised steps untimed (allocations, kernel choice), then --steps timed, on the same
examples for every variant. Columns:
  s/step         seconds a timed step, the device synchronised at both ends
  tokens/s       the examples' tokens (prompt and answer, no padding) trained a second
  vs first       the first variant's seconds a step over this one's
Last line: RESULT {json} with every variant's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
import time

import torch

from asyncrl.config import load_config
from asyncrl.config_arguments import add_overrides_argument
from asyncrl.thinking import Thinking
from demo.tasks.catalog import task_kind
from demo.tiny.build import deterministic_kernels
from demo.tiny.model import build_tiny_model
from demo.tiny.vocabulary import build_tokenizer
from demo.tiny.warm_start import WARM_START_STREAM, example_source, warm_start

DEFAULT_VARIANTS = (
    "det-mb4=model.warm_start.deterministic=true model.warm_start.micro_batches=4",
    "det-mb16=model.warm_start.deterministic=true model.warm_start.micro_batches=16",
    "mb4=model.warm_start.deterministic=false model.warm_start.micro_batches=4",
    "mb16=model.warm_start.deterministic=false model.warm_start.micro_batches=16",
)
CHILD_TIMEOUT_S = 1200  # one variant: the model's build, the untimed and the timed steps


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpu_longtail.yaml", help="the config whose warm start is timed")
    parser.add_argument("--variant", action="append", metavar="NAME=KEY=VALUE ...",
                        help="a variant: its name, '=', then space-separated overrides (repeatable; default: "
                             "deterministic kernels on and off, at 4 and 16 micro-batches)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed supervised steps before the timed ones")
    parser.add_argument("--steps", type=int, default=20, help="timed supervised steps per variant")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a variant's overrides, JSON: run it here and print JSON
    add_overrides_argument(parser, "config overrides every variant shares (before the variant's own)")
    return parser.parse_args()


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'name=k=v k2=v2' → (name, [k=v, k2=v2])."""
    name, separator, overrides = text.partition("=")
    if not separator or not name or not overrides.strip():
        raise SystemExit(f"--variant {text!r}: expected NAME=KEY=VALUE [KEY=VALUE ...]")
    return name, overrides.split()


def time_variant(config_path: str, overrides: list[str], warmup_steps: int, steps: int) -> dict:
    """Build the model and time its supervised steps under `overrides` (run in a process of its own)."""
    config = load_config(config_path, overrides)
    schedule = config.model.warm_start
    tokenizer = build_tokenizer(config.model.tiny.tokenizer)
    thinking = Thinking.for_tokenizer(config.rollout.thinking, tokenizer)
    held_out = task_kind(config.task).split(config.task, config.run.seed).val_questions
    device = torch.device(schedule.device)
    model = build_tiny_model(config.model.tiny, tokenizer, config.run.seed).to(device)

    def run(count: int) -> float:
        part = dataclasses.replace(schedule, steps=count)
        _synchronise(device)
        started = time.perf_counter()
        with deterministic_kernels(schedule.deterministic and device.type == "cuda"):
            warm_start(model, tokenizer, config.task, part, config.run.seed, held_out, thinking)
        _synchronise(device)
        return time.perf_counter() - started

    run(warmup_steps)
    seconds = run(steps)
    # the timed steps' examples: warm_start draws them from the same stream for every call
    examples = example_source(tokenizer, config.task, dataclasses.replace(schedule, steps=steps), held_out, thinking)
    rng = random.Random(config.run.seed + WARM_START_STREAM)
    tokens = sum(len(ids) for _ in range(steps) for ids, _ in examples(rng))
    return {"step_s": round(seconds / steps, 4), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "parameters": sum(p.numel() for p in model.parameters()), "device": _device_name(device)}


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_child(args: argparse.Namespace, overrides: list[str]) -> dict:
    """One variant in a process of its own; its last stdout line is its JSON figures."""
    command = [sys.executable, __file__, "--config", args.config, "--warmup-steps", str(args.warmup_steps),
               "--steps", str(args.steps), "--child", json.dumps(overrides)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr, flush=True)
        return {"error": f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_speedups(results: dict[str, dict]) -> None:
    """Each variant's `speedup`: the first variant's seconds a step over its own (None where either failed)."""
    first = next(iter(results.values())).get("step_s")
    for figures in results.values():
        figures["speedup"] = round(first / figures["step_s"], 3) if first and figures.get("step_s") else None


def print_table(results: dict[str, dict]) -> None:
    print("| variant | s/step | tokens/s | vs first |")
    print("|---|---|---|---|")
    for name, figures in results.items():
        ratio = f"{figures['speedup']:.2f}x" if figures["speedup"] is not None else "-"
        print(f"| {name} | {figures.get('step_s') or figures.get('error')} | {figures.get('tokens_per_s', '-')} | "
              f"{ratio} |")


def main() -> None:
    args = parse_args()
    if args.child is not None:
        print(json.dumps(time_variant(args.config, json.loads(args.child), args.warmup_steps, args.steps)))
        return
    variants = [parse_variant(text) for text in (args.variant or DEFAULT_VARIANTS)]
    results = {}
    for name, overrides in variants:
        results[name] = run_child(args, [*args.overrides, *overrides])
        print(f"{name}: {results[name]}", flush=True)
    add_speedups(results)
    print_table(results)
    print("RESULT " + json.dumps({"config": args.config, "overrides": args.overrides, "steps": args.steps,
                                  "variants": results}))


if __name__ == "__main__":
    main()
