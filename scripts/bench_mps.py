"""The one-GPU async job with its roles under CUDA MPS against the same job taking turns on the GPU, side by side on
one host from one prepared model.

Runs the race's async job (scripts/bench_time_to_score.py's, on configs/gpu_longtail.yaml and the overrides given)
for --steps steps twice: `run.mps=off` (the learner's and the engine's kernels take turns) and `run.mps=on` (they run
at once; a daemon that cannot start ends the run), unscored, then compares their pace from the runs' records: trained
tokens/s after the warm-up steps, a step's wait for its batch and its training, training's tokens/s while it trains,
the learner's share of a step, and whether each run's roles were served by an MPS server (`under_mps`, from
RUN_DIR/logs/mps/serving). --archive-dir keeps each arm's records (ARM.tar.gz, written as soon as its run ends);
--restore ARM=FILE puts an arm's archived records back, and --arms '' then only reports them.
Last line: RESULT {json} with mps_speedup (trained tokens/s under MPS over taking turns) and each arm's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.config import load_config
from asyncrl.config_arguments import add_config_arguments
from asyncrl.metrics import read_metrics
from demo.tiny.report import read_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, only scripts/ is on the path
from scripts.bench_time_to_score import prepare, run_job  # noqa: E402
from scripts.race_figures import ratio, rounded  # noqa: E402
from scripts.race_runs import Mode, summarise  # noqa: E402
from scripts.run_records import archive_records, read_launch, restore_records  # noqa: E402

ARMS = {"turns": "run.mps=off", "mps": "run.mps=on"}  # arm -> its override; the first is the baseline
FIGURES = ("trained_tokens_per_s", "training_tokens_per_s", "learner_share", "step_s", "wait_s", "train_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "configs/gpu_longtail.yaml", "config overrides for both runs")
    parser.add_argument("--steps", type=int, default=16, help="learner steps per run")
    parser.add_argument("--max-staleness", type=int, default=2, help="K of the async job")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of both runs")
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the token rate")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"what to run now, comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--skip-prepare", action="store_true", help="the task's files and the model exist already")
    parser.add_argument("--archive-dir", default="", help="write each arm's records into ARM.tar.gz here")
    parser.add_argument("--restore", nargs="*", action="extend", default=[], metavar="ARM=FILE",
                        help="an arm's records written by --archive-dir, put into --out-dir first")
    parser.add_argument("--out-dir", default="", help="where the runs go (default: a new temporary directory)")
    args = parser.parse_intermixed_args(argv)
    args.sync_ranks = 0  # what bench_time_to_score's job builder reads (its synchronous runs only)
    if unknown := {arm for arm in args.arms.split(",") if arm} - set(ARMS):
        parser.error(f"--arms: unknown arm(s) {sorted(unknown)} (choose from {', '.join(ARMS)})")
    args.restore = dict(_arm_archive(parser, item) for item in args.restore)  # arm -> its archive
    return args


def _arm_archive(parser: argparse.ArgumentParser, item: str) -> tuple[str, str]:
    arm, _, archive = item.partition("=")
    if arm not in ARMS or not Path(archive).is_file():
        parser.error(f"--restore {item}: give ARM=FILE, ARM one of {', '.join(ARMS)} and FILE an archive")
    return arm, archive


def run_arm(arm: str, mode: Mode, args: argparse.Namespace, root: Path, start_weights: str | None) -> None:
    """The async job with the arm's override, in root/ARM, validated only at its first and last versions."""
    arm_args = argparse.Namespace(**vars(args) | {"overrides": [*args.overrides, ARMS[arm]]})
    run_job(mode, args.seed, arm_args, args.steps, args.steps, root / arm, start_weights)


def arm_figures(arm_root: Path, mode: Mode, seed: int, warmup_steps: int) -> dict[str, Any]:
    """One arm's pace from its run's records."""
    name = mode.run_name(seed)
    records = read_metrics(arm_root / name)
    launch = read_launch(arm_root, name)
    run = summarise(records, {}, {}, launch["time"], mode, warmup_steps)
    timed = [r for r in records if "batch/samples" in r and r["step"] > mode.warmup(warmup_steps)]
    means = {f"{key}_s": statistics.fmean(r[f"timing_s/{source}"] for r in timed)
             for key, source in (("step", "step"), ("wait", "wait_batch"), ("train", "train"))}
    return {key: run[key] for key in FIGURES if key in run} | means | {
        "steps": run["steps"], "under_mps": launch.get("under_mps"), "start_weights": launch.get("start_weights")}


def report(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table and the RESULT's contents."""
    base, other = (figures.get(arm) for arm in ARMS)
    print(f"{'figure':<32}" + "".join(f"{arm:>14}" for arm in ARMS) + f"{'mps / turns':>14}")
    for key in (*FIGURES, "steps", "under_mps"):
        cells = [(figures[arm].get(key) if arm in figures else None) for arm in ARMS]
        ratio_cell = ratio(cells[1], cells[0]) if key in FIGURES and None not in cells else None
        print(f"{key:<32}" + "".join(f"{_cell(value):>14}" for value in [*cells, ratio_cell]))
    speedup = ratio(other["trained_tokens_per_s"], base["trained_tokens_per_s"]) if base and other else None
    same_start = base["start_weights"] == other["start_weights"] if base and other else None
    return {"mps_speedup": speedup, "same_start": same_start,
            **{arm: {key: rounded(value, 3) if isinstance(value, float) else value for key, value in figures[arm].items()}
               for arm in ARMS if arm in figures}}


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def main() -> None:
    args = parse_args()
    mode = Mode("async", args.max_staleness)
    root = Path(args.out_dir or tempfile.mkdtemp(prefix="asyncrl-mps-"))
    root.mkdir(parents=True, exist_ok=True)
    for arm, archive in args.restore.items():
        restore_records([archive], root / arm)
    arms = [arm for arm in args.arms.split(",") if arm]
    config = load_config(args.config, args.overrides)
    if arms and not args.skip_prepare:
        prepare(args, config.learner.compile)
    start_weights = read_report(Path(config.model.path)).get("weights_sha256")
    for arm in arms:
        run_arm(arm, mode, args, root, start_weights)
        if args.archive_dir:
            Path(args.archive_dir).mkdir(parents=True, exist_ok=True)
            archive_records(root / arm, Path(args.archive_dir) / f"{arm}.tar.gz")
    figures = {arm: arm_figures(root / arm, mode, args.seed, args.warmup_steps)
               for arm in ARMS if (root / arm / mode.run_name(args.seed)).is_dir()}
    print("RESULT " + json.dumps(report(figures)), flush=True)


if __name__ == "__main__":
    main()
