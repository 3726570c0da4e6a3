"""The learning-rate sweep that picks the race's rate: the synchronous run (`learner.mode=synchronous`) once per rate of
--lrs, from the same warm-started model and seed, --at-once of them side by side, then every due version of every run
scored by one `asyncrl evaluate` call (the race's evaluator: the same held-out prompts and seeds for all), which deletes
each snapshot's weights once scored (at the runs' end the disk holds all their snapshots: 3 rates x 7 versions of a
~600 M-parameter model take ~25 GB).

The race's rate is one at which the synchronous run, the baseline, improves steadily (at a rate too high for it, both
modes collapse and the race proves nothing), so the sweep runs the baseline alone. Side by side on one GPU the runs
share the card: give each its part (`run.gpu_memory_gib`) and a fixed KV cache (`rollout.engine.kv_cache_memory_gib`:
vLLM otherwise sizes it from what it measures while the others start too); their timings mean nothing here, only
their held-out scores per version do. Run directories go to --out-dir (lr-<rate>, each with its console log in
lr-<rate>.log); a rate whose run made its last version there before is not run again.

A table: the held-out score (`val/score/mean`) at each due version, one column per rate, then each rate's best and
final score. Last line: RESULT {json} with `rates` (per rate: `curve` [[version, score], ...], `best`, `final`,
`rise`: final less version 0's) and `highest_final`, the rate whose final score is highest. Run with
scripts/cpu_env.sh sourced on CPU; on a GPU, `scripts/gpu_bench.sh sweep`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from asyncrl.config_arguments import add_config_arguments
from asyncrl.snapshots import made_times, read_evaluation

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, only scripts/ is on the path
from scripts.bench_time_to_score import JOB_TIMEOUT_S, asyncrl_command, evaluate  # noqa: E402
from scripts.race_runs import SCORE_KEY  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--lrs", required=True, help="comma-separated learning rates (learner.lr), one run each")
    parser.add_argument("--steps", type=int, required=True, help="learner steps per run")
    parser.add_argument("--val-every", type=int, required=True, help="versions between scored snapshots")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of every run")
    parser.add_argument("--at-once", type=int, default=0, help="runs side by side (0: all of them)")
    parser.add_argument("--eval-engines", type=int, default=1, help="engines scoring the snapshots side by side")
    parser.add_argument("--out-dir", required=True, help="where the run directories and their logs go")
    return parser.parse_args()


def run_name(rate: str) -> str:
    return f"lr-{rate}"


def run_rate(rate: str, args: argparse.Namespace, root: Path) -> None:
    """The synchronous run at `rate`, its console output in root/lr-<rate>.log: skipped where it made its last
    version before, started afresh where it stopped short (the synchronous reference does not resume)."""
    name = run_name(rate)
    if args.steps in made_times(root / name):
        print(f"lr {rate}: run finished before in {root / name}", flush=True)
        return
    shutil.rmtree(root / name, ignore_errors=True)
    overrides = [f"run.root_dir={root}", f"run.name={name}", f"run.seed={args.seed}", "learner.mode=synchronous",
                 f"learner.total_steps={args.steps}", f"validation.every={args.val_every}",
                 "validation.after_run=true", "metrics.wandb_mode=disabled", *args.overrides, f"learner.lr={rate}"]
    with open(root / f"{name}.log", "w") as log:
        done = subprocess.run(asyncrl_command("run", "--config", args.config, *overrides), stdout=log,
                              stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"lr {rate}: asyncrl run exited with {done.returncode} (its output: {root / name}.log)")
    print(f"lr {rate}: trained {args.steps} steps", flush=True)


def run_all(rates: list[str], args: argparse.Namespace, root: Path) -> None:
    """Every rate's run, --at-once at a time; the first failure starts no more runs and ends the sweep once the runs
    started have ended."""
    with concurrent.futures.ThreadPoolExecutor(args.at_once or len(rates)) as pool:  # subprocess waits free the GIL
        futures = [pool.submit(run_rate, rate, args, root) for rate in rates]
        try:
            for future in futures:
                future.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def rate_figures(directory: Path) -> dict[str, Any]:
    """A run's scored curve (version order), its best and final score, and its rise from version 0; None for what
    its scores cannot give (no version scored: an evaluation that failed; version 0 unscored: no rise)."""
    evaluation = read_evaluation(directory)
    curve = [[version, round(evaluation[version][SCORE_KEY], 4)] for version in sorted(evaluation)]
    if not curve:
        return {"curve": [], "best": None, "final": None, "rise": None}
    scores = [score for _, score in curve]
    rise = round(scores[-1] - scores[0], 4) if curve[0][0] == 0 else None
    return {"curve": curve, "best": max(scores), "final": scores[-1], "rise": rise}


def print_table(rates: dict[str, dict[str, Any]]) -> None:
    labels = list(rates)
    versions = sorted({version for figures in rates.values() for version, _ in figures["curve"]})
    scores = {label: dict(map(tuple, figures["curve"])) for label, figures in rates.items()}
    rows = [["version", *(f"lr {label}" for label in labels)]]
    rows += [[str(version), *(_cell(scores[label].get(version)) for label in labels)] for version in versions]
    rows += [[key, *(_cell(rates[label][key]) for label in labels)] for key in ("best", "final", "rise")]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    args = parse_args()
    rates = [rate.strip() for rate in args.lrs.split(",") if rate.strip()]
    root = Path(args.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    run_all(rates, args, root)
    # the race's evaluator: one call, every run
    evaluate([root / run_name(rate) for rate in rates], args.eval_engines, last_try=True)
    figures = {rate: rate_figures(root / run_name(rate)) for rate in rates}
    print_table(figures)
    scored = [rate for rate in rates if figures[rate]["final"] is not None]
    highest = max(scored, key=lambda rate: figures[rate]["final"]) if scored else None
    print(f"highest final score: {f'lr {highest}' if highest else 'none (no rate was scored)'}", flush=True)
    print("RESULT " + json.dumps({"rates": figures, "highest_final": highest, "steps": args.steps,
                                  "val_every": args.val_every, "seed": args.seed}), flush=True)


if __name__ == "__main__":
    main()
