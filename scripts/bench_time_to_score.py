"""Time to a held-out score: the same job run synchronously and asynchronously from the same warm-started model.

The synchronous reference (`asyncrl run learner.mode=synchronous`: one process generates a batch, trains one step
on it, loads the new weights, validates when due) is the baseline; the async job is `asyncrl run` with
K = --max-staleness. Both run --steps steps on the GPUs this process sees (`asyncrl run` places them: one GPU
shared by the learner and the server, or the server on GPU 0 and the learner on GPU 1; docs/placement.md) and
validate every --val-every versions on the same held-out prompts with the same seeds. Before them the task's
files and the model are made (`asyncrl data`, `asyncrl init-model`: cached), outside the clock.

Per mode, from its metrics.jsonl (`asyncrl.metrics.read_metrics`):
  time to target   seconds from the job's launch to the end of the first step whose version validated at
                   least the target; the end of step v is the record of step v - 1 plus step v's own
                   `timing_s/step` (the async learner's last record waits for the final validation pass). The
                   reference's passes stop its loop: their `val/seconds` are taken off its clock. The async
                   job's passes run beside generation on server 0 and stay on its clock (they slow it a little).
  target           --target, or --target-fraction of the way from the start score (version 0's, the lower of
                   the two runs') to the best score both runs reached (the lower of their bests)
  trained tokens/s trained response tokens (`batch/samples` x `response_length/mean`) per second of its clock,
                   from the end of the warm-up steps (--warmup-steps, at least K + 1 for the async job, whose first
                   steps drain a backlog) to the step before the last
  length ratio     mean trained response length / mean generated: the reference trains all it generates (1 by
                   construction); the async job's generated mean is its buffer's `response_length/generated_mean`
  buckets          held-out reward per response-length bucket (`val/score/bucket/*`, validation.length_buckets)
                   at the last version both runs validated: equal steps
The table puts the two modes side by side with async / sync; the last line is RESULT {json} with
time_to_score_speedup, trained_tokens_speedup, length_ratio (the async job's), gpus and each mode's figures.
--modes runs a subset; with a fixed --out-dir a mode run before is read back, so the modes can run in separate
calls (each under a host's time limit) and still be compared; --modes '' only reports.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import load_config
from asyncrl.metrics import METRICS_FILE, read_metrics
from asyncrl.placement import visible_gpus
from asyncrl.validation_scores import VERSION_KEY

MODES = ("sync", "async")
LEARNER_MODE = {"sync": "synchronous", "async": "async"}
SCORE_KEY = "val/score/mean"
BUCKET_PREFIX = "val/score/bucket/"
GENERATED_MEAN_KEY = "response_length/generated_mean"  # the buffer's mean response length of what it stored
LAUNCH_SUFFIX = ".launch.json"  # beside each run directory: when the bench launched it (Unix time), on how many GPUs
JOB_TIMEOUT_S = 7200  # one mode's whole job, engine start included
MIN_TIMED_STEPS = 2  # fewer give no token rate worth printing

Record = dict[str, Any]


@dataclass(frozen=True)
class Mode:
    """One of the two runs."""

    name: str  # "sync" or "async"
    k: int  # buffer.max_staleness of the async job

    @property
    def run_name(self) -> str:
        return "tts-sync" if self.name == "sync" else f"tts-async-k{self.k}"

    @property
    def label(self) -> str:
        return "sync" if self.name == "sync" else f"async K={self.k}"

    @property
    def validation_stops_clock(self) -> bool:
        """The reference validates between steps; the async job's server 0 validates beside its generation."""
        return self.name == "sync"

    def warmup(self, warmup_steps: int) -> int:
        """Steps left out of the token rate: the async job's first step lets the server fill the buffer K + 1
        batches ahead, which the next K steps drain without waiting."""
        return warmup_steps if self.name == "sync" else max(warmup_steps, self.k + 1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpu_longtail.yaml", help="asyncrl config of the job")
    parser.add_argument("--steps", type=int, default=0, help="learner steps per mode (0: the config's learner.total_steps)")
    parser.add_argument("--max-staleness", type=int, default=2, help="K of the async job")
    parser.add_argument("--val-every", type=int, default=0, help="versions between validations (0: the config's)")
    parser.add_argument("--target", type=float, default=None, help="held-out score to reach (default: --target-fraction)")
    parser.add_argument("--target-fraction", type=float, default=0.8,
                        help="target = start + this x (the lower best - start), when --target is not given")
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the token rate")
    parser.add_argument("--modes", default=",".join(MODES), help="modes to run now, comma-separated ('' = only report)")
    parser.add_argument("--out-dir", default="", help="where the run directories go; runs there are read back "
                                                      "(default: a new temporary directory)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for both modes")
    return parser.parse_args()


def asyncrl_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch", *args]


def prepare(args: argparse.Namespace) -> None:
    """The task's files and the warm-started model both modes start from (init-model is cached by its settings)."""
    for command in ("data", "init-model"):
        subprocess.run(asyncrl_command(command, "--config", args.config, *args.overrides), check=True)


def run_mode(mode: Mode, args: argparse.Namespace, steps: int, val_every: int, root: Path) -> None:
    """Run the mode from scratch with `asyncrl run` (a run of the same name in `root` is replaced)."""
    shutil.rmtree(root / mode.run_name, ignore_errors=True)
    overrides = [f"run.root_dir={root}", f"run.name={mode.run_name}", f"learner.mode={LEARNER_MODE[mode.name]}",
                 f"learner.total_steps={steps}", f"buffer.max_staleness={mode.k}", f"validation.every={val_every}",
                 "metrics.wandb_mode=disabled", *args.overrides]
    launch_file(root, mode).write_text(json.dumps({"time": time.time(), "gpus": len(visible_gpus())}))
    done = subprocess.run(asyncrl_command("run", "--config", args.config, *overrides), timeout=JOB_TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"{mode.label}: asyncrl run exited with {done.returncode}")


def launch_file(root: Path, mode: Mode) -> Path:
    return root / (mode.run_name + LAUNCH_SUFFIX)


def training_records(records: list[Record]) -> dict[int, Record]:
    """Each step's training record by step (the reference also logs version 0's validation as a step-0 record)."""
    return {r["step"]: r for r in records if "batch/samples" in r}


def passes(records: list[Record]) -> dict[int, Record]:
    """Each validated version's pass (its first report), by version."""
    found: dict[int, Record] = {}
    for record in records:
        if record.get(SCORE_KEY) is not None and VERSION_KEY in record:
            found.setdefault(int(record[VERSION_KEY]), record)
    return found


def step_clock(records: list[Record], launched: float, validation_stops_clock: bool) -> dict[int, float]:
    """Seconds since launch at each step's record, less the validation passes logged up to it when they stop
    the clock."""
    clock, paused = {}, 0.0
    for record in records:
        if validation_stops_clock:
            paused += record.get("val/seconds") or 0.0
        if "batch/samples" in record:
            clock[record["step"]] = record["time"] - launched - paused
    return clock


def version_made_at(clock: dict[int, float], steps: dict[int, Record], version: int) -> float:
    """Seconds since launch when step `version` ended: the previous step's record plus its own seconds (its own
    record may come later). Version 0 is the starting model: 0."""
    if version == 0:
        return 0.0
    if version - 1 not in clock:
        return clock[version]
    return clock[version - 1] + steps[version]["timing_s/step"]


def summarise(records: list[Record], launched: float, mode: Mode, warmup_steps: int) -> dict[str, Any]:
    """One mode's figures that need no target: scores, throughput, lengths and its validated versions."""
    steps, clock = training_records(records), step_clock(records, launched, mode.validation_stops_clock)
    numbers = sorted(steps)
    start, last = mode.warmup(warmup_steps), numbers[-2]  # the last step waits for the final validation
    timed = [steps[n] for n in numbers if start < n <= last]
    trained_mean = sum(map(trained_tokens, steps.values())) / sum(r["batch/samples"] for r in steps.values())
    generated_mean = trained_mean if mode.name == "sync" else steps[numbers[-1]].get(GENERATED_MEAN_KEY)
    validated = passes(records)
    scores = {version: record[SCORE_KEY] for version, record in sorted(validated.items())}
    return {
        "steps": numbers[-1], "first_record_s": clock[numbers[0]], "last_record_s": clock[numbers[-1]],
        "trained_tokens_per_s": sum(map(trained_tokens, timed)) / (clock[last] - clock[start]),
        "trained_length_mean": trained_mean, "generated_length_mean": generated_mean,
        "length_ratio": trained_mean / generated_mean if generated_mean else None,
        "start_score": scores.get(0), "best_score": max(scores.values(), default=None),
        "scores": scores, "made_at": {v: version_made_at(clock, steps, v) for v in scores if v == 0 or v in steps},
        "buckets": {version: bucket_scores(record) for version, record in validated.items()},
    }


def trained_tokens(step: Record) -> float:
    return step["batch/samples"] * step["response_length/mean"]


def bucket_scores(record: Record) -> dict[str, float]:
    return {key[len(BUCKET_PREFIX):]: value for key, value in record.items() if key.startswith(BUCKET_PREFIX)}


def pick_target(summaries: list[dict[str, Any]], target: float | None, fraction: float) -> float | None:
    """`target`, or `fraction` of the way from the lower start score to the lower best score; None when no run
    improved on that start (no target to reach)."""
    if target is not None:
        return target
    starts = [s["start_score"] for s in summaries if s["start_score"] is not None]
    bests = [s["best_score"] for s in summaries if s["best_score"] is not None]
    if not starts or not bests or min(bests) <= min(starts):
        return None
    return min(starts) + fraction * (min(bests) - min(starts))


def time_to_target(summary: dict[str, Any], target: float | None) -> tuple[int, float] | tuple[None, None]:
    """(version, seconds) of the first validated version at or above `target`; (None, None) if none."""
    if target is None:
        return None, None
    for version, score in sorted(summary["scores"].items()):
        if score >= target and version in summary["made_at"]:
            return version, summary["made_at"][version]
    return None, None


def equal_step_buckets(sync: dict[str, Any], async_: dict[str, Any]) -> tuple[int | None, dict[str, dict[str, float]]]:
    """The last version both runs validated, and each length bucket's held-out score there in both."""
    common = sorted(set(sync["buckets"]) & set(async_["buckets"]))
    if not common:
        return None, {}
    version = common[-1]
    names = sorted(set(sync["buckets"][version]) & set(async_["buckets"][version]), key=bucket_low)
    return version, {name: {"sync": sync["buckets"][version][name], "async": async_["buckets"][version][name]}
                     for name in names}


def bucket_low(name: str) -> int:
    """The lower end of a bucket name "<lo>-<hi>", its order."""
    return int(name.split("-")[0])


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference to 3 decimals; None when either is missing or the reference is 0."""
    return round(value / reference, 3) if value is not None and reference else None


def compare(sync: dict[str, Any], async_: dict[str, Any], target: float | None) -> dict[str, Any]:
    """Async against sync: time to the target (sync's seconds / async's), trained tokens/s, bucket scores."""
    version, buckets = equal_step_buckets(sync, async_)
    sync_time, async_time = time_to_target(sync, target)[1], time_to_target(async_, target)[1]
    return {
        "time_to_score_speedup": ratio(sync_time, async_time),
        "trained_tokens_speedup": ratio(async_["trained_tokens_per_s"], sync["trained_tokens_per_s"]),
        "length_vs_sync": ratio(async_["trained_length_mean"], sync["trained_length_mean"]),
        "equal_step_version": version, "buckets": buckets,
        "every_bucket_at_least_sync": all(b["async"] >= b["sync"] for b in buckets.values()) if buckets else None,
    }


def mode_figures(summary: dict[str, Any], target: float | None) -> dict[str, Any]:
    """The per-mode part of RESULT."""
    version, seconds = time_to_target(summary, target)
    return {"time_to_target_s": _round(seconds), "version_at_target": version,
            "trained_tokens_per_s": _round(summary["trained_tokens_per_s"]),
            "trained_length_mean": _round(summary["trained_length_mean"]),
            "generated_length_mean": _round(summary["generated_length_mean"]),
            "length_ratio": _round(summary["length_ratio"], 3), "start_score": _round(summary["start_score"], 3),
            "best_score": _round(summary["best_score"], 3), "first_record_s": _round(summary["first_record_s"]),
            "last_record_s": _round(summary["last_record_s"]), "steps": summary["steps"]}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def print_table(figures: dict[str, dict[str, Any]], comparison: dict[str, Any] | None, target: float | None) -> None:
    """The modes side by side, async / sync where both ran, then the buckets at equal steps."""
    labels = list(figures)
    print(f"target held-out score: {'none (no run improved)' if target is None else f'{target:.3f}'}")
    print(f"{'':34}" + "".join(f"{label:>14}" for label in labels) + ("    async/sync" if len(labels) == 2 else ""))
    rows = [("time to target (s)", "time_to_target_s", True), ("version at target", "version_at_target", False),
            ("trained tokens/s", "trained_tokens_per_s", True), ("trained length mean", "trained_length_mean", True),
            ("generated length mean", "generated_length_mean", False), ("trained / generated length", "length_ratio", False),
            ("start score", "start_score", False), ("best score", "best_score", False),
            ("first step's record (s)", "first_record_s", False), ("last step's record (s)", "last_record_s", False)]
    for title, key, compared in rows:
        values = [figures[label][key] for label in labels]
        line = f"{title:34}" + "".join(f"{_cell(value):>14}" for value in values)
        if compared and len(labels) == 2:
            speedup = ratio(values[0], values[1]) if key == "time_to_target_s" else ratio(values[1], values[0])
            line += f"{_cell(speedup, 'x'):>14}"
        print(line)
    if comparison and comparison["buckets"]:
        print(f"held-out score per response-length bucket at version {comparison['equal_step_version']}:")
        for name, pair in comparison["buckets"].items():
            print(f"  {name + ' tokens':32}{pair['sync']:>14.3f}{pair['async']:>14.3f}{_cell(ratio(pair['async'], pair['sync']), 'x'):>14}")


def _cell(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.3f}{unit}" if isinstance(value, float) and unit else str(value)


def main() -> None:
    args = parse_args()
    config = load_config(args.config, args.overrides)
    steps, val_every = args.steps or config.learner.total_steps, args.val_every or config.validation.every
    if not val_every:
        raise SystemExit("time to score needs validation: set --val-every or validation.every in the config")
    modes = [Mode("sync", args.max_staleness), Mode("async", args.max_staleness)]
    if short := [mode.label for mode in modes if steps - 1 - mode.warmup(args.warmup_steps) < MIN_TIMED_STEPS]:
        raise SystemExit(f"{steps} steps leave fewer than {MIN_TIMED_STEPS} timed steps for {', '.join(short)} "
                         "(the warm-up steps, at least K + 1 for the async job, and the last step are not timed)")
    wanted = [name for name in args.modes.split(",") if name]
    if unknown := set(wanted) - set(MODES):
        raise SystemExit(f"--modes: unknown mode(s) {sorted(unknown)} (choose from {', '.join(MODES)})")
    root = Path(args.out_dir or tempfile.mkdtemp(prefix="asyncrl-tts-"))
    root.mkdir(parents=True, exist_ok=True)
    if wanted:
        prepare(args)
    for mode in modes:
        if mode.name in wanted:
            run_mode(mode, args, steps, val_every, root)
    ran = [mode for mode in modes if (root / mode.run_name / METRICS_FILE).is_file()]
    launches = {mode.label: json.loads(launch_file(root, mode).read_text()) for mode in ran}
    summaries = {mode.label: summarise(read_metrics(root / mode.run_name), launches[mode.label]["time"], mode,
                                       args.warmup_steps) for mode in ran}
    target = pick_target(list(summaries.values()), args.target, args.target_fraction)
    figures = {label: mode_figures(summary, target) for label, summary in summaries.items()}
    sync, async_ = (summaries.get(mode.label) for mode in modes)
    comparison = compare(sync, async_, target) if sync and async_ else None
    print_table(figures, comparison, target)
    if comparison is None:
        print(f"run the other mode (--modes) with --out-dir {root} to compare them")
        return
    result = {key: comparison[key] for key in ("time_to_score_speedup", "trained_tokens_speedup")}
    gpus = launches[modes[1].label].get("gpus", len(visible_gpus()))  # where the runs ran: a report may run elsewhere
    result |= {"length_ratio": figures[modes[1].label]["length_ratio"], "gpus": gpus,
               "target": _round(target, 3), "max_staleness": args.max_staleness, "steps": steps, "val_every": val_every,
               "sync": figures[modes[0].label], "async": figures[modes[1].label]}
    result |= {key: comparison[key] for key in ("length_vs_sync", "equal_step_version", "buckets", "every_bucket_at_least_sync")}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
