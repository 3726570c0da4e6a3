"""Staleness study: held-out reward, off-policy drift and throughput against the staleness K, per policy loss
and number of mini-batches M, with samples trained exactly K versions stale.

Each cell (K, loss, M, seed) is one full `asyncrl run` of the config: same data and warm-started model,
`buffer.max_staleness=K` and `buffer.study_lag_versions=K` (the servers sample with the learner's weights of
K versions ago and one batch starts per version, so every sample trained at version v ≥ K came from π_{v−K}
while the learner's proximal policy is π_v; the first K steps can only be v stale), `algorithm.loss=<loss>`,
`algorithm.mini_batches=M` (M optimizer steps per batch: π_θ leaves π_prox inside the batch), `run.seed=<seed>`
(prompt order and sampling), --steps learner steps, validation of version 0 and of the final version on the
held-out file. K = 0 is the on-policy baseline (no lag). Per cell:
  val score      `val/score/mean` of the final version (mean reward over held-out prompts, n samples each)
  mismatch KL    mean of `rollout_corr/mismatch_kl` over the steps at full lag (version >= K)
  masked frac    mean of `trust_region/masked_frac` over the same steps: the share of trained tokens whose
                 gradient a behaviour-anchored mask removed (dppo_tv, dppo_kl, m2po; None for the others)
  clip frac      mean of `actor/pg_clipfrac` over the same steps (the share the loss's clip or cap changed)
  IS clip frac   mean of `rollout_corr/is_clip_frac` over the same steps (0 for naive_ppo: it corrects nothing)
  IS weight      mean of `rollout_corr/is_weight_mean` over the same steps
  staleness      mean of `staleness/mean` over all steps (the warm-up included), and the min / max trained
                 staleness over the steps at full lag (K and K when the setting holds)
  samples/s      trained samples per second of learner wall time, step 1 (engine start) excluded
Rows aggregate the seeds of a (K, loss, M): means, the standard deviation of the final reward over seeds, and
samples/s as a ratio to K = 0 of the same loss and M. With the lag every step waits for a batch sampled after
the previous broadcast, so samples/s is the synchronous pace at every K: it is reported, not studied.
A cell finished by an earlier study with the same --steps, overrides and --out-dir is reused, so an interrupted
study continues where it stopped (cells run seed by seed: a study cut short has whole seeds first). --jobs runs
that many cells at once; --gpus spreads them over GPUs (each cell sees one, learner and server sharing it);
--stop-starting-after-s starts no cell past that time, so a study under a wall-clock limit ends with whole
cells. Run with scripts/cpu_env.sh sourced on CPU; on GPUs, `scripts/gpu_bench.sh study`.
Last line: RESULT {json}: `cells`, one per run (k, loss, mini_batches, seed, val_start, val_score, mismatch_kl,
masked_frac and the rest), and `rows`, one per (K, loss, M) over the seeds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.config_arguments import add_config_arguments
from asyncrl.metrics import read_metrics
from asyncrl.whole_files import write_json_whole

DEFAULT_CONFIG = "configs/quickstart.yaml"
LOSSES = ("naive_ppo", "decoupled_ppo", "tis", "seq_mask", "dppo_tv", "dppo_kl", "m2po",
          "decoupled_ppo_kl")  # registry names in learner/maths/losses.py, in the tables' order
CELL_FILE = "study_cell.json"  # a finished cell's result in its run directory; a rerun reuses it


@dataclass
class Cell:
    k: int
    loss: str
    mini_batches: int  # M: optimizer steps per batch
    seed: int
    steps: int  # learner steps of the run
    overrides: list[str]  # the study's extra overrides (a saved cell is reused only under the same ones)
    val_start: float | None  # val/score/mean of version 0
    val_score: float | None  # val/score/mean of the final version
    mismatch_kl: float | None  # mean rollout_corr/mismatch_kl over the steps at full lag
    masked_frac: float | None  # mean trust_region/masked_frac over the same steps (masking losses only)
    pg_clipfrac: float | None  # mean actor/pg_clipfrac over the same steps
    is_clip_frac: float | None  # mean rollout_corr/is_clip_frac over the same steps
    is_weight_mean: float | None  # mean rollout_corr/is_weight_mean over the same steps
    staleness_mean: float | None  # mean staleness/mean over all steps
    staleness_min: float | None  # smallest staleness/min over the steps at full lag
    staleness_max: float | None  # largest staleness/max over the steps at full lag
    samples_per_s: float | None
    wall_s: float  # the whole `asyncrl run`, engine start included
    returncode: int
    gpu: str | None = None  # the GPU the cell ran on (None: CPU)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, DEFAULT_CONFIG, "extra config overrides for every cell")
    parser.add_argument("--ks", default="0,4,8,16,32", help="comma-separated staleness values K (0 = the baseline)")
    parser.add_argument("--losses", default=",".join(LOSSES[:4]), help="comma-separated loss names")
    parser.add_argument("--mini-batches", default="1", help="comma-separated mini-batch counts M per batch")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds")
    parser.add_argument("--steps", type=int, default=60, help="learner steps per cell")
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once")
    parser.add_argument("--gpus", default="", help="comma-separated GPU ids the cells take in turn, each cell one "
                                                   "(empty: the config's devices, e.g. CPU)")
    parser.add_argument("--stop-starting-after-s", type=float, default=0.0,
                        help="start no cell later than this many seconds into the study (0: no limit); the cells "
                             "left are named and reported as not run")
    parser.add_argument("--cell-timeout-s", type=float, default=1800.0, help="a cell running longer is killed")
    parser.add_argument("--report-only", action="store_true",
                        help="report the cells finished earlier and run none (the others are named and left out)")
    parser.add_argument("--out-dir", default="runs/staleness_study")
    return parser.parse_args()


def asyncrl(*args: str, timeout_s: float, gpu: str | None = None) -> subprocess.CompletedProcess:
    env = os.environ.copy()
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env)


def prepare(args: argparse.Namespace) -> None:
    """Data files and the warm-started model, once: every cell starts from the same policy."""
    for command in ("data", "init-model"):
        done = asyncrl(command, "--config", args.config, *args.overrides, timeout_s=args.cell_timeout_s)
        if done.returncode != 0:
            sys.exit(f"asyncrl {command} failed:\n{done.stderr[-3000:]}")


def cell_name(k: int, loss: str, mini_batches: int, seed: int) -> str:
    return f"k{k}-{loss}-m{mini_batches}-seed{seed}"


def finished_cell(args: argparse.Namespace, name: str) -> Cell | None:
    """The saved result of cell `name` when an earlier study with the same --steps and overrides finished it."""
    saved = Path(args.out_dir) / name / CELL_FILE
    if not saved.is_file():
        return None
    try:
        cell = Cell(**json.loads(saved.read_text()))
    except TypeError:  # saved by an earlier version of this script, with other fields: run it again
        return None
    return cell if cell.returncode == 0 and cell.steps == args.steps and cell.overrides == args.overrides else None


def run_cell(args: argparse.Namespace, key: tuple[int, str, int, int], gpu: str | None) -> Cell:
    """One cell's run on `gpu` (None: where the config puts it)."""
    k, loss, mini_batches, seed = key
    name = cell_name(*key)
    run_dir = Path(args.out_dir) / name
    overrides = [
        *args.overrides, f"run.root_dir={args.out_dir}", f"run.name={name}", "learner.resume=never",
        f"buffer.max_staleness={k}", f"buffer.study_lag_versions={k}", f"algorithm.loss={loss}",
        f"algorithm.mini_batches={mini_batches}", f"run.seed={seed}", f"learner.total_steps={args.steps}",
        f"validation.every={args.steps}", "metrics.wandb_mode=disabled",
    ]
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-run cell starts over
    started = time.perf_counter()
    try:
        done = asyncrl("run", "--config", args.config, *overrides, timeout_s=args.cell_timeout_s, gpu=gpu)
        returncode, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired as timed_out:
        returncode, stderr = 124, f"timed out after {timed_out.timeout:.0f} s"
    wall = time.perf_counter() - started
    if returncode != 0:
        print(f"cell {name} failed ({returncode}):\n{stderr[-2000:]}", file=sys.stderr, flush=True)
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    cell = Cell(k, loss, mini_batches, seed, args.steps, list(args.overrides), **measure(records, k, args.steps),
                wall_s=round(wall, 1), returncode=returncode, gpu=gpu)
    write_json_whole(run_dir / CELL_FILE, asdict(cell))  # a later call reads it back: never half of it
    return cell


def measure(records: list[dict], k: int, steps: int) -> dict[str, float | None]:
    """A cell's measured fields from its run's metrics records (see the module's docstring)."""
    trained = [r for r in records if r.get("staleness/mean") is not None]
    lagged = [r for r in trained if r["step"] - 1 >= k]  # step s trains at version s − 1: at full lag from version K
    return {
        "val_start": _val_at(records, 0), "val_score": _val_at(records, steps),
        "mismatch_kl": _mean(r.get("rollout_corr/mismatch_kl") for r in lagged),
        "masked_frac": _mean(r.get("trust_region/masked_frac") for r in lagged),
        "pg_clipfrac": _mean(r.get("actor/pg_clipfrac") for r in lagged),
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


def run_cells(args: argparse.Namespace, order: list[tuple[int, str, int, int]]) -> list[Cell]:
    """Run every cell of `order` not finished before, --jobs at a time, each taking the next free GPU slot; no
    cell starts past --stop-starting-after-s."""
    gpus = [g for g in args.gpus.split(",") if g] or [None]
    slots: queue.Queue = queue.Queue()
    for index in range(args.jobs):
        slots.put(gpus[index % len(gpus)])  # jobs spread evenly: GPU i takes every len(gpus)-th slot
    deadline = time.monotonic() + args.stop_starting_after_s if args.stop_starting_after_s else None

    def run_in_slot(key: tuple[int, str, int, int]) -> Cell | None:
        if (cell := finished_cell(args, cell_name(*key))) is not None:
            return cell
        gpu = slots.get()
        try:
            if deadline is not None and time.monotonic() > deadline:
                return None
            return run_cell(args, key, gpu)
        finally:
            slots.put(gpu)

    cells = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for cell in pool.map(run_in_slot, order):
            if cell is not None:
                print(json.dumps(asdict(cell)), flush=True)
                cells.append(cell)
    return cells


def summarise(cells: list[Cell]) -> list[dict]:
    """One row per (K, loss, M): means over seeds, the seeds' spread of the final reward, throughput ratio to
    K = 0 of the same loss and M."""
    def order(key: tuple[int, str, int]) -> tuple:
        k, loss, mini_batches = key
        return LOSSES.index(loss) if loss in LOSSES else len(LOSSES), mini_batches, k

    rows = []
    for k, loss, mini_batches in sorted(dict.fromkeys((c.k, c.loss, c.mini_batches) for c in cells), key=order):
        mine = [c for c in cells if (c.k, c.loss, c.mini_batches) == (k, loss, mini_batches)]
        rows.append({
            "k": k, "loss": loss, "mini_batches": mini_batches, "seeds": [c.seed for c in mine],
            "val_start": _mean(c.val_start for c in mine), "val_score": _mean(c.val_score for c in mine),
            "val_score_std": _std(c.val_score for c in mine), "val_score_per_seed": [c.val_score for c in mine],
            "val_gain": _mean(c.val_score - c.val_start for c in mine
                              if c.val_score is not None and c.val_start is not None),
            "mismatch_kl": _mean(c.mismatch_kl for c in mine), "masked_frac": _mean(c.masked_frac for c in mine),
            "pg_clipfrac": _mean(c.pg_clipfrac for c in mine), "is_clip_frac": _mean(c.is_clip_frac for c in mine),
            "is_weight_mean": _mean(c.is_weight_mean for c in mine),
            "staleness_mean": _mean(c.staleness_mean for c in mine),
            "staleness_min": min((c.staleness_min for c in mine if c.staleness_min is not None), default=None),
            "staleness_max": max((c.staleness_max for c in mine if c.staleness_max is not None), default=None),
            "samples_per_s": _mean(c.samples_per_s for c in mine),
            "failed_cells": sum(1 for c in mine if c.returncode != 0),
        })
    for row in rows:
        baseline = next((r["samples_per_s"] for r in rows
                         if (r["loss"], r["mini_batches"], r["k"]) == (row["loss"], row["mini_batches"], 0)), None)
        row["throughput_vs_k0"] = row["samples_per_s"] / baseline if baseline and row["samples_per_s"] else None
    return rows


def print_table(rows: list[dict]) -> None:
    print("| K | loss | M | val start | val score (mean ± sd) | per seed | gain | mismatch KL | masked frac | "
          "clip frac | IS weight | staleness at full lag (min–max) | samples/s | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_seed = " ".join(_fmt(v) for v in r["val_score_per_seed"])
        print(f"| {r['k']} | {r['loss']} | {r['mini_batches']} | {_fmt(r['val_start'])} | {_fmt(r['val_score'])} ± "
              f"{_fmt(r['val_score_std'])} | {per_seed} | {_fmt(r['val_gain'], 3, signed=True)} | "
              f"{_fmt(r['mismatch_kl'], 4)} | {_fmt(r['masked_frac'], 4)} | {_fmt(r['pg_clipfrac'], 4)} | "
              f"{_fmt(r['is_weight_mean'], 3)} | {_fmt(r['staleness_min'], 0)}–{_fmt(r['staleness_max'], 0)} | "
              f"{_fmt(r['samples_per_s'], 1)} | {r['failed_cells']} |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward, drift, masked) = plt.subplots(1, 3, figsize=(15, 4.2))
    colours = {loss: plt.cm.tab10(index % 10) for index, loss in enumerate(dict.fromkeys(r["loss"] for r in rows))}
    for loss, mini_batches in dict.fromkeys((r["loss"], r["mini_batches"]) for r in rows):
        mine = [r for r in rows if (r["loss"], r["mini_batches"]) == (loss, mini_batches)]
        # one colour per loss, one line style per M
        line = {"color": colours[loss], "linestyle": "-" if mini_batches == 1 else "--", "marker": "o",
                "label": f"{loss} M={mini_batches}"}
        scored = [r for r in mine if r["val_score"] is not None]
        reward.errorbar([r["k"] for r in scored], [r["val_score"] for r in scored],
                        yerr=[r["val_score_std"] or 0.0 for r in scored], capsize=3, **line)
        measured = [r for r in mine if r["mismatch_kl"] is not None]
        drift.plot([r["k"] for r in measured], [r["mismatch_kl"] for r in measured], **line)
        held_back = [(r["k"], r["masked_frac"] if r["masked_frac"] is not None else r["pg_clipfrac"]) for r in mine]
        held_back = [(k, share) for k, share in held_back if share is not None]
        masked.plot([k for k, _ in held_back], [share for _, share in held_back], **line)
    reward.set(xlabel="staleness K (every sample exactly K old)", ylabel="final val/score/mean",
               title="held-out reward (mean ± sd over seeds)")
    drift.set(xlabel="staleness K", ylabel="rollout_corr/mismatch_kl", title="behaviour vs learner policy (KL)")
    masked.set(xlabel="staleness K", ylabel="masked (or else clipped) token share",
               title="tokens the loss's bound held back")
    for axes in (reward, drift, masked):
        axes.grid(alpha=0.3)
    reward.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def _fmt(value: float | None, digits: int = 3, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def main() -> None:
    args = parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    losses = args.losses.split(",")
    mini_batches = [int(m) for m in args.mini_batches.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    order = [(k, loss, m, seed) for seed in seeds for m in mini_batches for loss in losses for k in ks]
    if args.report_only:
        cells = [cell for key in order if (cell := finished_cell(args, cell_name(*key))) is not None]
    else:
        prepare(args)
        cells = run_cells(args, order)
    missing = [cell_name(*key) for key in order if not any((c.k, c.loss, c.mini_batches, c.seed) == key for c in cells)]
    print(f"reporting {len(cells)} finished cells; not run: {', '.join(missing) or 'none'}", flush=True)
    rows = summarise(cells)
    print_table(rows)
    plot_path = Path(args.out_dir) / "staleness_study.png"
    plot(rows, plot_path)
    print(f"plot: {plot_path}")
    fields = ("k", "loss", "mini_batches", "seed", "val_start", "val_score", "mismatch_kl", "masked_frac",
              "pg_clipfrac", "staleness_min", "staleness_max", "wall_s", "gpu")
    result = {"steps": args.steps, "seeds": seeds, "plot": str(plot_path),
              "cells": [{field: getattr(cell, field) for field in fields} for cell in cells], "rows": rows}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
