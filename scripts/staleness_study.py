"""Staleness study: held-out reward, off-policy drift and throughput against the staleness K, for naive PPO
(no off-policy correction), decoupled PPO, truncated IS and sequence masking, with samples trained exactly
K versions stale.

Each cell (K, loss, seed) is one full `asyncrl run` of the config: same data and warm-started model,
`buffer.max_staleness=K` and `buffer.study_lag_versions=K` (the servers sample with the learner's weights of
K versions ago and one batch starts per version, so every sample trained at version v ≥ K came from π_{v−K}
while the learner's proximal policy is π_v; the first K steps can only be v stale), `algorithm.loss=<loss>`,
`run.seed=<seed>` (prompt order and sampling), --steps learner steps, validation of version 0 and of the
final version on the held-out file. K = 0 is the on-policy baseline (no lag). Per cell:
  val final      `val/score/mean` of the final version (mean reward over held-out prompts, n samples each)
  mismatch KL    mean of `rollout_corr/mismatch_kl` over the steps at full lag (version >= K)
  IS clip frac   mean of `rollout_corr/is_clip_frac` over the same steps (0 for naive_ppo: it corrects nothing)
  IS weight      mean of `rollout_corr/is_weight_mean` over the same steps
  staleness      mean of `staleness/mean` over all steps (the warm-up included), and the min / max trained
                 staleness over the steps at full lag (K and K when the setting holds)
  samples/s      trained samples per second of learner wall time, step 1 (engine start) excluded
Rows aggregate the seeds of a (K, loss): means, the standard deviation of the final reward over seeds, and
samples/s as a ratio to K = 0 of the same loss. With the lag every step waits for a batch sampled after the
previous broadcast, so samples/s is the synchronous pace at every K: it is reported, not studied.
A cell finished by an earlier study with the same --steps, overrides and --out-dir is reused, so an interrupted
study continues where it stopped. --jobs runs that many cells at once. Run with scripts/cpu_env.sh sourced on CPU.
Last line: RESULT {json} with one entry per (K, loss): `val_final`, `mismatch_kl`, `samples_per_s` and the rest.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
LOSSES = ("naive_ppo", "decoupled_ppo", "tis", "seq_mask")  # registry names in learner/losses.py
CELL_FILE = "study_cell.json"  # a finished cell's result in its run directory; a rerun reuses it


@dataclass
class Cell:
    k: int
    loss: str
    seed: int
    steps: int  # learner steps of the run
    overrides: list[str]  # the study's extra overrides (a saved cell is reused only under the same ones)
    val_start: float | None  # val/score/mean of version 0
    val_final: float | None  # val/score/mean of the final version
    mismatch_kl: float | None  # mean rollout_corr/mismatch_kl over the steps at full lag
    is_clip_frac: float | None  # mean rollout_corr/is_clip_frac over the same steps
    is_weight_mean: float | None  # mean rollout_corr/is_weight_mean over the same steps
    staleness_mean: float | None  # mean staleness/mean over all steps
    staleness_min: float | None  # smallest staleness/min over the steps at full lag
    staleness_max: float | None  # largest staleness/max over the steps at full lag
    samples_per_s: float | None
    wall_s: float  # the whole `asyncrl run`, engine start included
    returncode: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--ks", default="0,4,8,16,32", help="comma-separated staleness values K (0 = the baseline)")
    parser.add_argument("--losses", default=",".join(LOSSES), help="comma-separated loss names")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds")
    parser.add_argument("--steps", type=int, default=60, help="learner steps per cell")
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once")
    parser.add_argument("--report-only", action="store_true",
                        help="report the cells finished earlier and run none (the others are named and left out)")
    parser.add_argument("--out-dir", default="runs/staleness_study")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (key=value) for every cell")
    return parser.parse_args()


def asyncrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=os.environ.copy())


def prepare(args: argparse.Namespace) -> None:
    """Data files and the warm-started model, once: every cell starts from the same policy."""
    for command in ("data", "init-model"):
        done = asyncrl(command, "--config", args.config, *args.overrides)
        if done.returncode != 0:
            sys.exit(f"asyncrl {command} failed:\n{done.stderr[-3000:]}")


def finished_cell(args: argparse.Namespace, name: str) -> Cell | None:
    """The saved result of cell `name` when an earlier study with the same --steps and overrides finished it."""
    saved = Path(args.out_dir) / name / CELL_FILE
    if not saved.is_file():
        return None
    cell = Cell(**json.loads(saved.read_text()))
    return cell if cell.returncode == 0 and cell.steps == args.steps and cell.overrides == args.overrides else None


def run_cell(args: argparse.Namespace, k: int, loss: str, seed: int) -> Cell:
    """One cell's run, or its saved result (`finished_cell`)."""
    name = f"k{k}-{loss}-seed{seed}"
    run_dir = Path(args.out_dir) / name
    if (cell := finished_cell(args, name)) is not None:
        return cell
    overrides = [
        *args.overrides, f"run.root_dir={args.out_dir}", f"run.name={name}", "learner.resume=never",
        f"buffer.max_staleness={k}", f"buffer.study_lag_versions={k}", f"algorithm.loss={loss}", f"run.seed={seed}",
        f"learner.total_steps={args.steps}", f"validation.every={args.steps}", "metrics.wandb_mode=disabled",
    ]
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-run cell starts over
    started = time.perf_counter()
    done = asyncrl("run", "--config", args.config, *overrides)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        print(f"cell {name} failed ({done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr, flush=True)
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    cell = Cell(k, loss, seed, args.steps, list(args.overrides), **measure(records, k, args.steps), wall_s=round(wall, 1),
                returncode=done.returncode)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CELL_FILE).write_text(json.dumps(asdict(cell)))
    return cell


def measure(records: list[dict], k: int, steps: int) -> dict[str, float | None]:
    """A cell's measured fields from its run's metrics records (see the module's docstring)."""
    trained = [r for r in records if r.get("staleness/mean") is not None]
    lagged = [r for r in trained if r["step"] - 1 >= k]  # step s trains at version s − 1: at full lag from version K
    return {
        "val_start": _val_at(records, 0), "val_final": _val_at(records, steps),
        "mismatch_kl": _mean(r.get("rollout_corr/mismatch_kl") for r in lagged),
        "is_clip_frac": _mean(r.get("rollout_corr/is_clip_frac") for r in lagged),
        "is_weight_mean": _mean(r.get("rollout_corr/is_weight_mean") for r in lagged),
        "staleness_mean": _mean(r["staleness/mean"] for r in trained),
        "staleness_min": min((r["staleness/min"] for r in lagged), default=None),
        "staleness_max": max((r["staleness/max"] for r in lagged), default=None),
        "samples_per_s": _samples_per_s(records),
    }


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


def _std(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.stdev(present) if len(present) > 1 else None


def summarise(cells: list[Cell]) -> list[dict]:
    """One row per (K, loss): means over seeds, the seeds' spread of the final reward, throughput ratio to K=0."""
    rows = []
    for k, loss in sorted(dict.fromkeys((c.k, c.loss) for c in cells), key=lambda key: (LOSSES.index(key[1])
                                                                                          if key[1] in LOSSES else 99, key[0])):
        mine = [c for c in cells if (c.k, c.loss) == (k, loss)]
        rows.append({
            "k": k, "loss": loss, "seeds": [c.seed for c in mine],
            "val_start": _mean(c.val_start for c in mine), "val_final": _mean(c.val_final for c in mine),
            "val_final_std": _std(c.val_final for c in mine), "val_final_per_seed": [c.val_final for c in mine],
            "mismatch_kl": _mean(c.mismatch_kl for c in mine), "is_clip_frac": _mean(c.is_clip_frac for c in mine),
            "is_weight_mean": _mean(c.is_weight_mean for c in mine),
            "staleness_mean": _mean(c.staleness_mean for c in mine),
            "staleness_min": min((c.staleness_min for c in mine if c.staleness_min is not None), default=None),
            "staleness_max": max((c.staleness_max for c in mine if c.staleness_max is not None), default=None),
            "samples_per_s": _mean(c.samples_per_s for c in mine),
            "failed_cells": sum(1 for c in mine if c.returncode != 0),
        })
    for row in rows:
        baseline = next((r["samples_per_s"] for r in rows if r["loss"] == row["loss"] and r["k"] == 0), None)
        row["throughput_vs_k0"] = row["samples_per_s"] / baseline if baseline and row["samples_per_s"] else None
    return rows


def print_table(rows: list[dict]) -> None:
    print("| K | loss | val start | val final (mean ± sd) | per seed | mismatch KL | IS clip frac | IS weight | "
          "staleness mean | staleness at full lag (min–max) | samples/s | vs K=0 | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_seed = " ".join(_fmt(v) for v in r["val_final_per_seed"])
        print(f"| {r['k']} | {r['loss']} | {_fmt(r['val_start'])} | {_fmt(r['val_final'])} ± {_fmt(r['val_final_std'])} | "
              f"{per_seed} | {_fmt(r['mismatch_kl'], 4)} | {_fmt(r['is_clip_frac'], 4)} | {_fmt(r['is_weight_mean'], 3)} | "
              f"{_fmt(r['staleness_mean'], 2)} | {_fmt(r['staleness_min'], 0)}–{_fmt(r['staleness_max'], 0)} | "
              f"{_fmt(r['samples_per_s'], 1)} | {_fmt(r['throughput_vs_k0'], 2)} | {r['failed_cells']} |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward, drift, clipped) = plt.subplots(1, 3, figsize=(14, 3.8))
    for loss in dict.fromkeys(r["loss"] for r in rows):
        mine = [r for r in rows if r["loss"] == loss]
        scored = [r for r in mine if r["val_final"] is not None]
        reward.errorbar([r["k"] for r in scored], [r["val_final"] for r in scored],
                        yerr=[r["val_final_std"] or 0.0 for r in scored], marker="o", capsize=3, label=loss)
        measured = [r for r in mine if r["mismatch_kl"] is not None]
        drift.plot([r["k"] for r in measured], [r["mismatch_kl"] for r in measured], marker="o", label=loss)
        clipped.plot([r["k"] for r in measured], [r["is_clip_frac"] for r in measured], marker="o", label=loss)
    reward.set(xlabel="staleness K (every sample exactly K old)", ylabel="final val/score/mean",
               title="held-out reward (mean ± sd over seeds)")
    drift.set(xlabel="staleness K", ylabel="rollout_corr/mismatch_kl", title="behaviour vs learner policy (KL)")
    clipped.set(xlabel="staleness K", ylabel="rollout_corr/is_clip_frac", title="tokens the correction changed")
    for axes in (reward, drift, clipped):
        axes.legend(fontsize=8)
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
    order = [(k, loss, seed) for seed in seeds for loss in losses for k in ks]  # a cut-short study has whole seeds
    if args.report_only:
        cells = [cell for k, loss, seed in order if (cell := finished_cell(args, f"k{k}-{loss}-seed{seed}")) is not None]
        missing = [f"k{k}-{loss}-seed{seed}" for k, loss, seed in order
                   if not any((c.k, c.loss, c.seed) == (k, loss, seed) for c in cells)]
        print(f"reporting {len(cells)} finished cells; not run: {', '.join(missing) or 'none'}", flush=True)
    else:
        prepare(args)
        cells = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for cell in pool.map(lambda key: run_cell(args, *key), order):
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
