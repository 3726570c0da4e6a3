"""Staleness study: final validation reward and training throughput against the staleness bound K, for
naive PPO (no off-policy correction) and decoupled PPO, on the quickstart's task.

Each cell (K, loss, seed) is one full `asyncrl run` of the config: same data and warm-started model,
`buffer.max_staleness=K`, `algorithm.loss=<loss>`, `run.seed=<seed>` (prompt order and sampling),
--steps learner steps, validation of version 0 and the final version on the held-out file.
  final val     `val/score/mean` of the final version (mean reward over held-out prompts, n samples each)
  samples/s     trained samples per second of learner wall time, step 1 (engine start) excluded
  staleness     mean of `staleness/mean` over the steps
The baseline is K=0 with the same loss and seed, in the same study: each cell's throughput is also
reported as a ratio to it. A cell finished by an earlier study with the same --steps and --out-dir is
reused, so an interrupted study continues where it stopped. Run with scripts/cpu_env.sh sourced on CPU.
Last line: RESULT {json} with one entry per (K, loss): means over seeds and the per-seed values.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.metrics import read_metrics

DEFAULT_CONFIG = "configs/quickstart.yaml"
RUN_TIMEOUT_S = 1800  # one cell, engine start included; a hung cell must not hang the study
LOSSES = ("naive_ppo", "decoupled_ppo")  # registry names in learner/losses.py
CELL_FILE = "study_cell.json"  # a finished cell's result in its run directory; a rerun reuses it


@dataclass
class Cell:
    k: int
    loss: str
    seed: int
    steps: int  # learner steps of the run
    val_start: float | None  # val/score/mean of version 0
    val_final: float | None  # val/score/mean of the final version
    samples_per_s: float | None
    staleness_mean: float | None
    wall_s: float  # the whole `asyncrl run`, engine start included
    returncode: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--ks", default="0,1,2,4,8", help="comma-separated staleness bounds")
    parser.add_argument("--losses", default=",".join(LOSSES), help="comma-separated loss names")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds")
    parser.add_argument("--steps", type=int, default=100, help="learner steps per cell")
    parser.add_argument("--out-dir", default="runs/staleness_study")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (key=value) for every cell")
    return parser.parse_args()


def asyncrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=os.environ.copy())


def prepare(args: argparse.Namespace) -> None:
    """Data files and the warm-started model, once: every cell starts from the same policy."""
    for command in ("data", "init-model"):
        done = asyncrl(command, "--config", args.config, *args.overrides)
        if done.returncode != 0:
            sys.exit(f"asyncrl {command} failed:\n{done.stderr[-3000:]}")


def run_cell(args: argparse.Namespace, k: int, loss: str, seed: int) -> Cell:
    """One cell's run, or its saved result when an earlier study with the same --steps finished it."""
    name = f"k{k}-{loss}-seed{seed}"
    run_dir = Path(args.out_dir) / name
    saved = run_dir / CELL_FILE
    if saved.is_file():
        cell = Cell(**json.loads(saved.read_text()))
        if cell.returncode == 0 and cell.steps == args.steps:
            return cell
    overrides = [
        *args.overrides, f"run.root_dir={args.out_dir}", f"run.name={name}", "learner.resume=never",
        f"buffer.max_staleness={k}", f"algorithm.loss={loss}", f"run.seed={seed}",
        f"learner.total_steps={args.steps}", f"validation.every={args.steps}", "metrics.wandb_mode=disabled",
    ]
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-run cell starts over
    started = time.perf_counter()
    done = asyncrl("run", "--config", args.config, *overrides)
    wall = time.perf_counter() - started
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    cell = Cell(k, loss, seed, args.steps, _val_at(records, 0), _val_at(records, args.steps), _samples_per_s(records),
                _mean(r.get("staleness/mean") for r in records), round(wall, 1), done.returncode)
    saved.write_text(json.dumps(asdict(cell)))
    return cell


def _val_at(records: list[dict], version: int) -> float | None:
    values = [r["val/score/mean"] for r in records if r.get("val/version") == version and r.get("val/score/mean") is not None]
    return values[-1] if values else None


def _samples_per_s(records: list[dict]) -> float | None:
    """Samples trained after step 1 over the wall time from step 1's record to the last one."""
    steps = [r for r in records if r.get("batch/samples") is not None]
    if len(steps) < 2:
        return None
    return sum(r["batch/samples"] for r in steps[1:]) / (steps[-1]["time"] - steps[0]["time"])


def _mean(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarise(cells: list[Cell]) -> list[dict]:
    """One row per (K, loss): means over seeds, throughput ratio to K=0 of the same loss."""
    rows = []
    for k, loss in dict.fromkeys((c.k, c.loss) for c in cells):
        mine = [c for c in cells if (c.k, c.loss) == (k, loss)]
        rows.append({
            "k": k, "loss": loss, "seeds": [c.seed for c in mine],
            "val_start": _mean(c.val_start for c in mine), "val_final": _mean(c.val_final for c in mine),
            "val_final_per_seed": [c.val_final for c in mine],
            "samples_per_s": _mean(c.samples_per_s for c in mine),
            "staleness_mean": _mean(c.staleness_mean for c in mine),
            "failed_cells": sum(1 for c in mine if c.returncode != 0),
        })
    for row in rows:
        baseline = next((r["samples_per_s"] for r in rows if r["loss"] == row["loss"] and r["k"] == 0), None)
        row["throughput_vs_k0"] = row["samples_per_s"] / baseline if baseline and row["samples_per_s"] else None
    return rows


def print_table(rows: list[dict]) -> None:
    print("| K | loss | val start | val final | final per seed | samples/s | vs K=0 | staleness mean | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_seed = " ".join(_fmt(v) for v in r["val_final_per_seed"])
        print(f"| {r['k']} | {r['loss']} | {_fmt(r['val_start'])} | {_fmt(r['val_final'])} | {per_seed} | "
              f"{_fmt(r['samples_per_s'], 1)} | {_fmt(r['throughput_vs_k0'], 2)} | {_fmt(r['staleness_mean'], 2)} | "
              f"{r['failed_cells']} |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward, speed) = plt.subplots(1, 2, figsize=(10, 3.5))
    for loss in dict.fromkeys(r["loss"] for r in rows):
        mine = [r for r in rows if r["loss"] == loss and r["val_final"] is not None]
        reward.plot([r["k"] for r in mine], [r["val_final"] for r in mine], marker="o", label=loss)
        fast = [r for r in rows if r["loss"] == loss and r["samples_per_s"] is not None]
        speed.plot([r["k"] for r in fast], [r["samples_per_s"] for r in fast], marker="o", label=loss)
    reward.set(xlabel="max_staleness K", ylabel="final val/score/mean", title="held-out reward")
    speed.set(xlabel="max_staleness K", ylabel="samples/s", title="training throughput")
    for axes in (reward, speed):
        axes.legend()
        axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    args = parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    losses = args.losses.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    prepare(args)
    cells = []
    for seed in seeds:
        for loss in losses:
            for k in ks:
                cell = run_cell(args, k, loss, seed)
                print(json.dumps(asdict(cell)), flush=True)
                cells.append(cell)
    rows = summarise(cells)
    print_table(rows)
    plot_path = Path(args.out_dir) / "staleness_study.png"
    plot(rows, plot_path)
    print(f"plot: {plot_path}")
    print("RESULT " + json.dumps({"steps": args.steps, "seeds": seeds, "plot": str(plot_path), "cells": rows}), flush=True)


if __name__ == "__main__":
    main()
