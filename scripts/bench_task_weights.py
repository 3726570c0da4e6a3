"""Dynamic task weights against fixed weights: the held-out reward of a slowly improving task beside one
that saturates at once.

Two tasks on the tiny model, warm-started as the quickstart's is (two-digit additions from a sloppy teacher,
--warm-start-steps): `digits` asks two-digit additions and rewards any answer made of digits (a format reward
the model meets from the first step: it saturates), `add2` asks other two-digit additions scored by exact
match (the quickstart's task, which RL improves over tens of steps). Each cell is
one full `asyncrl run` from the same model and data, `run.seed=<seed>`, --steps learner steps, equal starting
weights, with `data.task_weights.enabled` false (the baseline, fixed weights) or true (dynamic, the settings
below); validation of version 0 and the final version on each task's held-out file.
  add2 start/final  `val/add2/score/mean` of version 0 / the final version (held-out exact-match reward)
  vs fixed          the final add2 reward minus that of fixed weights with the same seed
  add2 share        add2's share of the samples trained in the last quarter of the steps
A cell finished by an earlier run of this script with the same --steps and --out-dir is reused. Run with
scripts/cpu_env.sh sourced on CPU. Last line: RESULT {json} with the per-seed cells and the means.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.config_arguments import add_overrides_argument
from asyncrl.data import write_rows
from asyncrl.metrics import read_metrics
from asyncrl.whole_files import write_json_whole
from demo.tasks import arithmetic
from rollout_servers.rewards.builtin import exact_match

RUN_TIMEOUT_S = 1800  # one cell, engine start included
CELL_FILE = "bench_cell.json"
TASKS = {"digits": 2, "add2": 2}  # data source → digits per operand (each task draws its own questions)
SATURATING_TASK, SLOW_TASK = "digits", "add2"
NUM_VAL, NUM_TRAIN = 64, 4000  # held-out and training prompts per task
DYNAMIC = ["data.task_weights.enabled=true", "data.task_weights.patience=5", "data.task_weights.min_delta=0.02",
           "data.task_weights.factor=0.5", "data.task_weights.min_weight=0.1"]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The cells' reward (reward.custom_fn points here): a digits-only answer for `digits`, exact match otherwise."""
    if data_source == SATURATING_TASK:
        return float(solution_str.strip().isdigit())
    return exact_match(solution_str, ground_truth)


@dataclass
class Cell:
    mode: str  # "fixed" or "dynamic"
    seed: int
    steps: int
    slow_final: float | None  # val/add2/score/mean of the final version
    fast_final: float | None  # val/digits/score/mean of the final version
    slow_start: float | None  # val/add2/score/mean of version 0
    slow_share_late: float | None  # add2's share of the samples trained in the last quarter of the steps
    wall_s: float
    returncode: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds")
    parser.add_argument("--steps", type=int, default=60, help="learner steps per cell")
    parser.add_argument("--warm-start-steps", type=int, default=800, help="supervised steps of the shared model")
    parser.add_argument("--out-dir", default="runs/bench_task_weights")
    add_overrides_argument(parser, "extra config overrides for every cell")
    return parser.parse_args()


def asyncrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=os.environ.copy())


def write_task_files(out: Path) -> dict[str, tuple[str, str]]:
    """Train and held-out files per task (held-out questions never in training), written once."""
    files = {}
    for task, digits in TASKS.items():
        train, val = out / f"{task}_train.jsonl", out / f"{task}_val.jsonl"
        if not (train.is_file() and val.is_file()):
            rng = random.Random(task)
            held_out = dict(arithmetic.make_problem(rng, digits, digits, "+") for _ in range(NUM_VAL * 4))
            held_out = dict(list(held_out.items())[:NUM_VAL])
            problems = []
            while len(problems) < NUM_TRAIN:
                question, answer = arithmetic.make_problem(rng, digits, digits, "+")
                if question not in held_out:
                    problems.append((question, answer))
            write_rows(_rows(task, problems, "train"), train)
            write_rows(_rows(task, list(held_out.items()), "val"), val)
        files[task] = (str(train), str(val))
    return files


def _rows(task: str, problems: list[tuple[str, str]], split: str) -> list[dict]:
    return [arithmetic.make_row(question, answer, index, split) | {"data_source": task}
            for index, (question, answer) in enumerate(problems)]


def common_overrides(args: argparse.Namespace, files: dict[str, tuple[str, str]]) -> list[str]:
    out = Path(args.out_dir).resolve()
    return [
        f"model.path={out / 'model'}", "task.min_digits=2", "task.max_digits=2", "task.operators=+",
        f"model.warm_start.steps={args.warm_start_steps}", "model.warm_start.label_noise=0.3",
        f"data.train_files=[{','.join(train for train, _ in files.values())}]",
        f"data.val_files=[{','.join(val for _, val in files.values())}]",
        f"reward.custom_fn.path={Path(__file__).resolve()}", "reward.custom_fn.name=compute_score",
        "metrics.wandb_mode=disabled", *args.overrides,
    ]


def run_cell(args: argparse.Namespace, common: list[str], mode: str, seed: int) -> Cell:
    name = f"{mode}-seed{seed}"
    run_dir = Path(args.out_dir) / name
    saved = run_dir / CELL_FILE
    if saved.is_file():
        cell = Cell(**json.loads(saved.read_text()))
        if cell.returncode == 0 and cell.steps == args.steps:
            return cell
    overrides = [*common, f"run.root_dir={args.out_dir}", f"run.name={name}", "learner.resume=never", f"run.seed={seed}",
                 f"learner.total_steps={args.steps}", f"validation.every={args.steps}", *(DYNAMIC if mode == "dynamic" else [])]
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.perf_counter()
    done = asyncrl("run", "--config", "configs/quickstart.yaml", *overrides)
    wall = time.perf_counter() - started
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    cell = Cell(mode, seed, args.steps, _val(records, SLOW_TASK, args.steps), _val(records, SATURATING_TASK, args.steps),
                _val(records, SLOW_TASK, 0), _late_share(records, args.steps), round(wall, 1), done.returncode)
    write_json_whole(saved, asdict(cell))  # a later call reads it back: never half of it
    if done.returncode != 0:
        print(f"cell {name} failed:\n{done.stderr[-2000:]}", file=sys.stderr, flush=True)
    return cell


def _val(records: list[dict], task: str, version: int) -> float | None:
    key = f"val/{task}/score/mean"
    values = [r[key] for r in records if r.get("val/version") == version and r.get(key) is not None]
    return values[-1] if values else None


def _late_share(records: list[dict], steps: int) -> float | None:
    late = [r for r in records if r["step"] > steps * 3 // 4]
    total = sum(r.get("batch/samples", 0.0) for r in late)
    return sum(r.get(f"batch/{SLOW_TASK}/samples", 0.0) for r in late) / total if total else None


def _mean(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summarise(cells: list[Cell]) -> dict:
    """Means per mode, and the dynamic cells' gain on the slow task over fixed weights of the same seed."""
    fixed = {c.seed: c.slow_final for c in cells if c.mode == "fixed"}
    gains = [c.slow_final - fixed[c.seed] for c in cells
             if c.mode == "dynamic" and c.slow_final is not None and fixed.get(c.seed) is not None]
    modes = {mode: {"slow_final": _mean(c.slow_final for c in cells if c.mode == mode),
                    "fast_final": _mean(c.fast_final for c in cells if c.mode == mode),
                    "slow_share_late": _mean(c.slow_share_late for c in cells if c.mode == mode),
                    "failed_cells": sum(1 for c in cells if c.mode == mode and c.returncode != 0)} for mode in ("fixed", "dynamic")}
    return {"modes": modes, "slow_gain_per_seed": gains, "slow_gain_mean": _mean(gains),
            "dynamic_higher_in": sum(1 for gain in gains if gain > 0), "seeds_compared": len(gains)}


def print_table(cells: list[Cell]) -> None:
    print(f"| mode | seed | {SLOW_TASK} start | {SLOW_TASK} final | vs fixed | {SATURATING_TASK} final | {SLOW_TASK} share (last quarter) | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    fixed = {c.seed: c.slow_final for c in cells if c.mode == "fixed"}
    for c in sorted(cells, key=lambda c: (c.seed, c.mode != "fixed")):
        baseline = fixed.get(c.seed)
        gain = "-" if c.mode == "fixed" or baseline is None or c.slow_final is None else f"{c.slow_final - baseline:+.3f}"
        print(f"| {c.mode} | {c.seed} | {_fmt(c.slow_start)} | {_fmt(c.slow_final)} | {gain} | {_fmt(c.fast_final)} | "
              f"{_fmt(c.slow_share_late, 2)} | {c.wall_s:.0f} |")


def main() -> None:
    args = parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common = common_overrides(args, write_task_files(out.resolve()))
    built = asyncrl("init-model", "--config", "configs/quickstart.yaml", *common)
    if built.returncode != 0:
        sys.exit(f"asyncrl init-model failed:\n{built.stderr[-3000:]}")
    cells = []
    for seed in seeds:
        for mode in ("fixed", "dynamic"):
            cell = run_cell(args, common, mode, seed)
            print(json.dumps(asdict(cell)), flush=True)
            cells.append(cell)
    print_table(cells)
    print("RESULT " + json.dumps({"steps": args.steps, "seeds": seeds, "cells": [asdict(c) for c in cells]} | summarise(cells)),
          flush=True)


if __name__ == "__main__":
    main()
