"""The race to a held-out score: the synchronous run and the async job from the same warm-started model, over
several seeds, each scored by one evaluator off both clocks.

Per seed, `asyncrl run` runs the synchronous reference (`learner.mode=synchronous`: generate a batch, train one step
on it, load the new weights, colocated on every GPU this process sees: one rank per GPU with its own engine, FSDP over
all of them, --sync-ranks to choose) and then the async job (K = --max-staleness), both with
`validation.after_run=true`: neither validates during its run; each keeps the weights of every due version
(every --val-every versions, and the last) with the time it made them. As soon as a run ends, `asyncrl evaluate
--drop-scored` scores its snapshots on an engine of its own (--eval-engines: that many engines of the same settings
side by side), with the run's held-out prompts and seeds, and deletes each snapshot's weights once scored: the disk
holds one run's snapshots at a time (a ~600 M-parameter model's 21 take ~25 GB; both modes' at once would not
leave room on a 64 GB host). Every run is scored by the same evaluator: its settings, prompts and seeds. So no pass
is on either clock, none takes generation's engine, and none is skipped (`validations_skipped` counts any missing;
`validations_unscored` the snapshots a --no-evaluate call left for a later one).
The task's files and the model are made first (`asyncrl data`, `asyncrl init-model`: cached), and the job's engine
is started once, so that vLLM's compile cache on the host holds the model's graphs before either mode launches (on
a fresh host the first engine to start compiles them: 60 s more on an H200); with `learner.compile=true` the learner
is loaded once too (`scripts/learner_warm_up.py`), for its compiled layers (the first mode paid ~30 s more).

Per run, from metrics.jsonl and evaluation.jsonl:
  curve            (version, seconds since the job's launch when the learner made that version, held-out score)
  trained tokens/s trained response tokens (`batch/samples` x `response_length/mean`) per second of its clock,
                   from the end of the warm-up steps (--warmup-steps, at least K + 1 for the async job, whose first
                   steps drain a backlog) to the last step
  generated tok/s  over the same steps, the response tokens the async job's buffer stored per second: below the
                   trained rate, those steps drained finished groups generated before them (sync: the trained rate)
  length ratio     mean trained response length / mean generated (the async job's generated mean is its buffer's
                   `response_length/generated_mean`; the synchronous run trains all it generates: 1)
  learner share    the synchronous step's share spent training (`timing_s/train` / `timing_s/step`)
  engine start     seconds the job's engine took to start (the slowest one's, from its role's log; in the run's
                   .launch.json): 13-25 s on an H200 from a warm compile cache; a compile, or an engine core
                   spawned rather than forked, adds 20-40 s
  engine begins    seconds from the launch until that engine began to start (its log line's whole seconds, less
                   its start): the job's imports, and for the async job the wait for the learner's addresses
Per mode, the seeds' mean curve (score and made-at time averaged per version). The target is --target-fraction of
the way from the start score (version 0's, the same model in both modes) to the lower of the two modes' best mean
score (or --target); a mode's time to score is the mean made-at time of the first version whose mean score reaches
it (`seed_time_to_score_speedups`: each seed's own race as well, its target from its two curves alone). Its
start-up is the mean made-at time of version 0 (launch to the first version, before any step); the time to
score after start-up (`time_to_score_after_start_up_speedup`) leaves it out, to tell the jobs' steady pace apart
from their start; their pace alone is the seconds a version took from the first scored version to the last
(`time_per_version_s`, `version_pace_speedup`), apart from where one noisy score crosses the target, and, scored or
not, the wall seconds a learner step took after the warm-up (`time_per_step_s`, `step_pace_speedup`). A plot
(time_to_score.png in --out-dir) draws every seed's curve and each mode's mean against wall-clock time. The table
puts the two modes side by side with async / sync; the last line is RESULT {json}.
--modes runs a subset; with a fixed --out-dir runs made before are read back (an unfinished evaluation is
completed), so the modes can run in separate calls (each under a host's time limit) and still be compared;
--modes '' only evaluates what is missing and reports; --prepare-only prepares (files, model, compile caches) and stops.
--side-by-side runs each seed's two modes at once on a host of an even number of GPUs, the synchronous run on the
first half and the async job on the other (each job sees only its half; each one's console in <run name>.log in
--out-dir): a seed's race in one session from one warm start, on the same host and hours; then one `asyncrl
evaluate` scores both runs' snapshots (both on the disk at once).
--async-servers N gives the async job N rollout servers (placed as `asyncrl run` places them: on one GPU, all beside
the learner), the config's rollout.max_inflight split among them and their CUDA graphs no larger than one's part
(`race_runs.servers_overrides`); the synchronous run keeps one engine per GPU. The preparation then starts both
modes' engine settings once (vLLM keys its compile cache by the sequences an engine runs at once), and the ceiling
keeps N engines full at once (RESULT: `async_servers`, `ceiling_engines`).
--modes ceiling measures the engine kept full on the job's task (scripts/engine_ceiling.py, once, into
ceiling.json in --out-dir): RESULT then adds `ceiling_tokens_per_s`, `ceiling_speedup` (the ceiling against sync's
trained tokens/s, the most any one-GPU async job could gain with its training hidden) and `async_share_of_ceiling`;
on one GPU also `turns_tokens_per_s`, `turns_speedup` and `async_share_of_turns` (generation at the ceiling and
training at sync's rate taking turns on the GPU, `race_figures.ceiling_figures`).
--archive FILE writes every run's records (config, metrics, snapshot made-times, scores, the learner's resolved plan; no
weights) and the ceiling into one .tar.gz; --restore FILE... puts such records back into --out-dir first, so seeds raced
in separate sessions are reported together (list their seeds in --seeds). Each run's launch record holds the digest of
the weights it started from (init-model's `weights_sha256`): `start_models_match` in RESULT says whether each seed's two
runs started from the same weights (false where a mode was prepared on another host whose warm start made other weights;
null where a model has no digest). It also holds the host (name, boot id, CPU, GPUs: `run_records.host_facts`) and its
CPU time over the run (`cpu_busy_share`, `cpu_steal_share`: `run_records.cpu_shares`); `same_host` says whether each
seed's two runs ran on one machine (false where they ran in separate sessions on two: one H100 host generated at half
another's pace from the same start; null for records without it).
--deadline T (Unix seconds, a lent host's end) watches each run: once it has made 12 steps, its seconds a step predict
when the call's runs and their scoring end (`race_deadline`: async ~1.35x sync's pace, 150 s of scoring); past T the
run is stopped and a pace of its seed runs instead (--pace-steps of sync, twice as many of async, unscored), and the
call ends with status 75: the session's time goes to figures that fit it, not to a race cut off before its scoring.
With --fastest-step-s S (the task's fastest synchronous step on record) the pace runs at once, no race step spent,
where even S a step would end past T.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn, Sequence

from asyncrl.config import load_config
from asyncrl.config_arguments import add_config_arguments
from asyncrl.metrics import METRICS_FILE
from asyncrl.gpu_ids import VISIBLE_DEVICES, visible_gpus
from asyncrl.snapshots import unscored_versions
from demo.tiny.report import read_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, only scripts/ is on the path
from scripts.child_result import result_of  # noqa: E402
from scripts.jobs_at_once import Job, run_at_once  # noqa: E402
from scripts.race_deadline import PACE_STEPS, DeadlinePassed, LaterRun, beyond_reach, wait_within  # noqa: E402
from scripts.race_figures import (ceiling_figures, equal_step_buckets, mean_curve, mode_figures,  # noqa: E402
                                   modes_match, pick_target, ratio, rounded, seed_speedups)
from scripts.race_report import cell, plot, print_ceiling, print_table  # noqa: E402
from scripts.race_runs import Mode, read_runs, servers_overrides  # noqa: E402
from scripts.run_records import (CEILING, CEILING_FILE, add_log_readings, archive_records,  # noqa: E402
                                 ceiling_engines, read_ceiling, restore_records, write_launch)

MODES = ("sync", "async")
RUNNABLE = MODES + (CEILING,)  # what --modes may name
CEILING_SCRIPT = Path(__file__).with_name("engine_ceiling.py")
LEARNER_WARM_UP_SCRIPT = Path(__file__).with_name("learner_warm_up.py")
LEARNER_MODE = {"sync": "synchronous", "async": "async"}
JOB_TIMEOUT_S = 7200  # one run's whole job, engine start included
MIN_TIMED_STEPS = 2  # fewer give no token rate worth printing
PACED_EXIT = 75  # the exit status of a call whose race would have ended past --deadline and ran a pace instead

# What the synchronous run is, by the GPUs it ran on (docs/placement.md): one process, its engine beside its policy.
SYNC_BASELINES = {0: "cpu", 1: "colocated_one_gpu"}

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The race's options; config overrides may come before, between and after them."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "configs/gpu_longtail.yaml", "config overrides for every run")
    parser.add_argument("--steps", type=int, default=0, help="learner steps per run (0: the config's learner.total_steps)")
    parser.add_argument("--max-staleness", type=int, default=2, help="K of the async job")
    parser.add_argument("--seeds", default="0", help="run.seed of each pair of runs, comma-separated")
    parser.add_argument("--val-every", type=int, default=0, help="versions between validations (0: the config's)")
    parser.add_argument("--target", type=float, default=None, help="held-out score to reach (default: --target-fraction)")
    parser.add_argument("--target-fraction", type=float, default=0.9,
                        help="target = start + this x (the lower of the modes' best mean score - start)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of the token rate")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"what to run now, comma-separated, of {', '.join(RUNNABLE)} ('' = only report)")
    parser.add_argument("--skip-prepare", action="store_true",
                        help="the task's files, the model and the compile caches exist already: prepare nothing")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only make the task's files and the model, and fill the compile caches (vLLM's, the "
                             "learner's)")
    parser.add_argument("--async-servers", type=int, default=1,
                        help="rollout servers of the async job on its GPUs (on one GPU all beside the learner: vLLM's "
                             "engine core is one CPU core's work, and a small model's engine can leave the GPU idle), "
                             "the config's rollout.max_inflight split among them; the ceiling keeps as many engines full")
    parser.add_argument("--sync-ranks", type=int, default=0,
                        help="ranks of the synchronous run, each with an engine on its GPU (0: one per visible GPU)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run each seed's two modes at once, sync on the first half of the GPUs this process "
                             "sees and async on the other half (an even number of GPUs)")
    parser.add_argument("--no-evaluate", action="store_true",
                        help="leave the scoring of the snapshots to a later call (--modes '' scores and reports)")
    parser.add_argument("--eval-engines", type=int, default=1, help="engines scoring the snapshots side by side")
    parser.add_argument("--ceiling-seconds", type=float, default=60.0, help="the ceiling's timed window")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="Unix time by which this call's runs and their scoring must end (a lent GPU host's end; "
                             f"0: none): once a run has made {PACE_STEPS[1]} steps its pace predicts that end, and past "
                             "the deadline the run is stopped and a pace runs instead (--pace-steps), after which the "
                             f"call exits with {PACED_EXIT}")
    parser.add_argument("--pace-steps", type=int, default=20,
                        help="the pace after a missed --deadline: steps of the synchronous run, twice as many of the "
                             "async job's, unscored, from the same start")
    parser.add_argument("--fastest-step-s", type=float, default=0.0,
                        help="with --deadline: the synchronous run's seconds a step on the fastest host on record for "
                             "this task and shape; a race that could not end by the deadline even at that pace is not "
                             "started, and the pace runs at once (0: the race always starts)")
    parser.add_argument("--archive", default="", help="write the runs' records and the ceiling into this .tar.gz")
    parser.add_argument("--restore", nargs="*", action="extend", default=[], metavar="FILE",
                        help="records written by --archive to put into --out-dir before anything runs; "
                             "several files, given after one --restore or each after its own")
    parser.add_argument("--out-dir", default="", help="where the run directories go; runs there are read back "
                                                      "(default: a new temporary directory)")
    args = parser.parse_intermixed_args(argv)
    if args.deadline and args.side_by_side:
        parser.error("--deadline watches one run at a time: it does not go with --side-by-side")
    if args.async_servers < 1:
        parser.error(f"--async-servers {args.async_servers}: the async job needs at least one server")
    if args.pace_steps < 1:
        parser.error(f"--pace-steps {args.pace_steps}: the pace needs at least one step")
    if args.fastest_step_s < 0 or (args.fastest_step_s and not args.deadline):
        parser.error(f"--fastest-step-s {args.fastest_step_s:g}: give a pace (seconds, above 0) with a --deadline")
    for archive in args.restore:
        if not Path(archive).is_file():
            parser.error(f"--restore {archive}: no such file (what follows --restore is read as its files: "
                         "give config overrides before it)")
    return args


def asyncrl_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch", *args]


def script_command(script: Path, args: argparse.Namespace, *options: str, overrides: tuple[str, ...] = ()) -> list[str]:
    """`script` (engine_ceiling.py, learner_warm_up.py) on the race's config and overrides, then `overrides` (a
    mode's own), with `options`."""
    return [sys.executable, str(script), "--config", args.config, *options, *args.overrides, *overrides]


def prepare(args: argparse.Namespace, compiles_learner: bool,
            engine_overrides: Sequence[tuple[str, ...]] = ((),)) -> None:
    """The task's files and the warm-started model every run starts from (init-model is cached by its settings), then
    one start of the job's engine for each of `engine_overrides` (the modes' engine settings: vLLM keys its compile
    cache by the sequences an engine runs at once), so that vLLM's compile cache on this host holds the model's graphs
    before either mode launches (the first run on a fresh host paid about 60 s more to start than the second), and
    where the learner compiles (`compiles_learner`), one load of it, for its compiled layers
    (`scripts/learner_warm_up.py`)."""
    for command in ("data", "init-model"):
        subprocess.run(asyncrl_command(command, "--config", args.config, *args.overrides), check=True)
    for overrides in dict.fromkeys(engine_overrides):
        subprocess.run(script_command(CEILING_SCRIPT, args, "--start-only", overrides=overrides), check=True,
                       timeout=JOB_TIMEOUT_S)
    if compiles_learner:
        subprocess.run(script_command(LEARNER_WARM_UP_SCRIPT, args), check=True, timeout=JOB_TIMEOUT_S)


def run_job(mode: Mode, seed: int, args: argparse.Namespace, steps: int, val_every: int, root: Path,
            start_weights: str | None, later: list[LaterRun] | None = None) -> None:
    """Run the mode's job for `seed` from scratch with `asyncrl run` (a run of the same name in `root` is replaced),
    on every GPU this process sees; `start_weights`, the digest of the model it starts from, goes into its launch
    record. With --deadline and the `later` runs of this call given, the run is watched: DeadlinePassed once it
    is stopped for the deadline (`race_deadline.wait_within`)."""
    job = job_for(mode, seed, args, steps, val_every, root, None)
    launch = write_launch(root, job.label, start_weights, len(visible_gpus()), steps)
    if args.deadline and later is not None:
        status = wait_within(subprocess.Popen(job.command, env=job.env), root / job.label, mode.name, steps, later,
                             args.deadline)
    else:
        status = subprocess.run(job.command, env=job.env, timeout=JOB_TIMEOUT_S).returncode
    if status != 0:
        raise SystemExit(f"{mode.label} seed {seed}: asyncrl run exited with {status}")
    add_log_readings(root, job.label, launch)


def run_pace(args: argparse.Namespace, root: Path, modes: list[Mode], seed: int, val_every: int,
             start_weights: str | None) -> None:
    """The pass that fits where the race did not: each of `modes` for --pace-steps (the async job twice as many: its
    steps run faster), unscored, from the same start; the caller reports it with `--modes ''` as a pace."""
    for mode in modes:
        steps = args.pace_steps * (1 if mode.name == "sync" else 2)
        print(f"deadline: a pace instead of the race: {mode.label} for {steps} steps, seed {seed}", flush=True)
        run_job(mode, seed, args, steps, val_every, root, start_weights)
        keep_records(args, root)


def run_side_by_side(modes: list[Mode], seed: int, args: argparse.Namespace, steps: int, val_every: int, root: Path,
                     start_weights: str | None) -> None:
    """Run the seed's jobs of `modes` (sync, async) at once, the synchronous run on the first half of the GPUs this
    process sees and the async job on the other half (`gpu_halves`): one host, one start model and the same hours for
    both; as soon as one fails, the other is stopped. Each job's console goes to its run's log beside its directory."""
    halves = gpu_halves(visible_gpus())
    jobs = [job_for(mode, seed, args, steps, val_every, root, gpus) for mode, gpus in zip(modes, halves)]
    launches = [write_launch(root, job.label, start_weights, len(gpus), steps) for job, gpus in zip(jobs, halves)]
    run_at_once(jobs, JOB_TIMEOUT_S)
    for job, launch in zip(jobs, launches):
        add_log_readings(root, job.label, launch)


def gpu_halves(gpus: list[int]) -> tuple[list[int], list[int]]:
    """The GPUs split in two equal halves, in order; SystemExit unless there is an even number of them."""
    if not gpus or len(gpus) % 2:
        raise SystemExit(f"--side-by-side gives each mode half of the GPUs: it needs an even number of them, "
                         f"and this process sees {len(gpus)}")
    half = len(gpus) // 2
    return gpus[:half], gpus[half:]


def job_for(mode: Mode, seed: int, args: argparse.Namespace, steps: int, val_every: int, root: Path,
            gpus: list[int] | None) -> Job:
    """The `asyncrl run` command of the mode's job for `seed` on `gpus` (None: every GPU this process sees; its run of
    the same name in `root` removed first), labelled with the run's name."""
    name = mode.run_name(seed)
    shutil.rmtree(root / name, ignore_errors=True)
    overrides = [f"run.root_dir={root}", f"run.name={name}", f"run.seed={seed}",
                 f"learner.mode={LEARNER_MODE[mode.name]}", f"learner.total_steps={steps}",
                 f"buffer.max_staleness={mode.k}", f"validation.every={val_every}", "validation.after_run=true",
                 "metrics.wandb_mode=disabled", *args.overrides, *mode.overrides]
    if mode.name == "sync":  # the baseline a user would pick: colocated on every GPU the async job gets
        overrides.append(f"learner.nproc={args.sync_ranks or max(1, len(visible_gpus() if gpus is None else gpus))}")
    env = os.environ | ({} if gpus is None else {VISIBLE_DEVICES: ",".join(map(str, gpus))})
    return Job(name, asyncrl_command("run", "--config", args.config, *overrides), env, root / f"{name}.log")


def sync_baseline(gpus: int, sync_run: Path) -> str:
    """What the synchronous run was, on the `gpus` the jobs got (docs/placement.md): with several ranks
    (`learner.nproc` in `sync_run`'s config) colocated, one per GPU, on all of them or some; with one, by `gpus`."""
    ranks = load_config(str(sync_run / "config.yaml")).learner.nproc
    if ranks > 1:
        return "colocated_all_gpus" if ranks == gpus else "colocated_some_gpus"
    return SYNC_BASELINES.get(gpus, "engine_and_learner_on_gpus_apart")


def measure_ceiling(args: argparse.Namespace, root: Path, async_overrides: tuple[str, ...]) -> None:
    """The engine kept full on the job's task, alone on the GPUs this process sees, into root/ceiling.json: as many
    engines as the async job's servers (`async_overrides`), kept full at once. Its table is shown; its RESULT line
    is not, so that this benchmark's own stays the only one."""
    result_of(script_command(CEILING_SCRIPT, args, "--seconds", str(args.ceiling_seconds),
                             "--out", str(root / CEILING_FILE), overrides=async_overrides),
              "the engine's ceiling", JOB_TIMEOUT_S)


def evaluate(run_dirs: list[Path], engines: int, last_try: bool = False) -> None:
    """Score every run's snapshots not scored yet (`asyncrl evaluate`), on `engines` engines of the same settings,
    deleting each snapshot's weights once scored. A failed call is reported and the benchmark goes on, so that the
    runs' records still reach the archive and the report: what it left unscored is tried once more after the runs
    (unless this is that `last_try`), then counts in `validations_skipped`."""
    if not run_dirs:
        return
    done = subprocess.run(asyncrl_command("evaluate", "--engines", str(engines), "--drop-scored", *map(str, run_dirs)),
                          timeout=JOB_TIMEOUT_S)
    if done.returncode != 0:
        then = "count as skipped validations" if last_try else "are tried once more after the runs"
        print(f"asyncrl evaluate exited with {done.returncode} (its log above): the snapshots it left unscored {then}",
              flush=True)


def unscored(run_dir: Path) -> bool:
    """The run has a snapshot not scored yet whose file is there (an engine would start for it)."""
    return bool(unscored_versions(run_dir)[0])


def main() -> None:
    args = parse_args()
    config = load_config(args.config, args.overrides)
    steps, val_every = args.steps or config.learner.total_steps, args.val_every or config.validation.every
    seeds = [int(seed) for seed in args.seeds.split(",") if seed]
    if not val_every:
        raise SystemExit("time to score needs validation: set --val-every or validation.every in the config")
    modes = [Mode("sync", args.max_staleness),
             Mode("async", args.max_staleness, args.async_servers, servers_overrides(config, args.async_servers))]
    if short := [mode.label for mode in modes if steps - mode.warmup(args.warmup_steps) < MIN_TIMED_STEPS]:
        raise SystemExit(f"{steps} steps leave fewer than {MIN_TIMED_STEPS} timed steps for {', '.join(short)} "
                         "(the warm-up steps, at least K + 1 for the async job, are not timed)")
    wanted = [name for name in args.modes.split(",") if name]
    if unknown := set(wanted) - set(RUNNABLE):
        raise SystemExit(f"--modes: unknown mode(s) {sorted(unknown)} (choose from {', '.join(RUNNABLE)})")
    if args.side_by_side and not args.prepare_only:  # refused before the preparation's minutes, not after
        if not set(MODES) <= set(wanted):
            raise SystemExit(f"--side-by-side runs sync and async at once: --modes must name both, not {args.modes!r}")
        gpu_halves(visible_gpus())
    root = Path(args.out_dir or tempfile.mkdtemp(prefix="asyncrl-tts-"))
    root.mkdir(parents=True, exist_ok=True)
    restore_records(args.restore, root)
    if (wanted or args.prepare_only) and not args.skip_prepare:
        prepare(args, config.learner.compile, [mode.overrides for mode in modes])
    if args.prepare_only:
        return
    start_weights = read_report(Path(config.model.path)).get("weights_sha256")  # of the model every run starts from
    if args.side_by_side:
        for seed in seeds:
            run_side_by_side(modes, seed, args, steps, val_every, root, start_weights)
            keep_records(args, root)  # before the scoring's minutes: a session cut there keeps the runs' pace
            if not args.no_evaluate:
                evaluate([root / mode.run_name(seed) for mode in modes], args.eval_engines)
                keep_records(args, root)
    else:
        run_one_at_a_time(args, root, [mode for mode in modes if mode.name in wanted], seeds, steps, val_every,
                          start_weights)
    if CEILING in wanted:
        measure_ceiling(args, root, modes[1].overrides)
        keep_records(args, root)  # before the scoring's minutes, as after each run
    ran = {mode: [seed for seed in seeds if (root / mode.run_name(seed) / METRICS_FILE).is_file()] for mode in modes}
    if not args.no_evaluate:  # what earlier calls left unscored (--no-evaluate, or a call cut short)
        run_dirs = [root / mode.run_name(seed) for mode in modes for seed in ran[mode]]
        evaluate([run_dir for run_dir in run_dirs if unscored(run_dir)], args.eval_engines, last_try=True)
    keep_records(args, root)
    report(args, root, modes, ran, steps, val_every)


def run_one_at_a_time(args: argparse.Namespace, root: Path, modes: list[Mode], seeds: list[int], steps: int,
                      val_every: int, start_weights: str | None) -> None:
    """Each seed's runs of `modes`, one after the other, each scored as it ends unless --no-evaluate. Under --deadline,
    a race out of reach from the start (`--fastest-step-s`) or a run stopped for it gives way to a pace of its seed
    (`run_pace`), and the call then ends with PACED_EXIT."""
    queue = [(seed, mode) for seed in seeds for mode in modes]
    if queue and (past := past_deadline_at_best(args, queue, steps)):
        pace_instead(args, root, modes, queue[0][0], val_every, start_weights,
                     f"at the fastest pace on record ({args.fastest_step_s:g} s a sync step) the race would end "
                     f"{past:.0f} s past its deadline: not started")
    for index, (seed, mode) in enumerate(queue):
        try:
            run_job(mode, seed, args, steps, val_every, root, start_weights, runs_after(queue, index, steps))
        except DeadlinePassed as passed:
            pace_instead(args, root, modes, seed, val_every, start_weights, str(passed))
        keep_records(args, root)  # before the scoring's minutes: a session cut there keeps the run's pace
        if not args.no_evaluate:  # its snapshots scored and dropped before the next run makes its own
            evaluate([root / mode.run_name(seed)], args.eval_engines)
            keep_records(args, root)


def past_deadline_at_best(args: argparse.Namespace, queue: list[tuple[int, Mode]], steps: int) -> float | None:
    """With --deadline and --fastest-step-s: how far past the deadline the queued runs and their scoring would end at
    the task's fastest pace on record (`race_deadline.beyond_reach`); None where they could end in time or unasked."""
    if not (args.deadline and args.fastest_step_s):
        return None
    return beyond_reach(time.time(), args.fastest_step_s, queue[0][1].name, steps, runs_after(queue, 0, steps),
                        args.deadline)


def runs_after(queue: list[tuple[int, Mode]], index: int, steps: int) -> list[LaterRun]:
    """The runs queued after the one at `index`, as the deadline's prediction counts them."""
    return [LaterRun(mode.name, steps) for _, mode in queue[index + 1:]]


def pace_instead(args: argparse.Namespace, root: Path, modes: list[Mode], seed: int, val_every: int,
                 start_weights: str | None, why: str) -> NoReturn:
    """The race gives way to a pace of `seed` (`run_pace`), for `why`; the call ends with PACED_EXIT."""
    print(f"deadline: {why}", flush=True)
    keep_records(args, root)
    run_pace(args, root, modes, seed, val_every, start_weights)
    raise SystemExit(PACED_EXIT)


def keep_records(args: argparse.Namespace, root: Path) -> None:
    """The records so far into --archive, after each run, again once it is scored, and at the end: a session cut
    short (a host's time spent while a run is scored, during the ceiling or the next run) still hands back every run
    it finished, its pace at least: one cut during its scoring comes back unscored."""
    if args.archive:
        archive_records(root, Path(args.archive))


def report(args: argparse.Namespace, root: Path, modes: list[Mode], ran: dict[Mode, list[int]], steps: int,
           val_every: int) -> None:
    records = read_runs(root, modes, ran, steps, val_every, scoring=not args.no_evaluate,
                        warmup_steps=args.warmup_steps)
    runs = records.runs
    means = {label: mean_curve([run["curve"] for run in group]) for label, group in runs.items()}
    target = pick_target(list(means.values()), args.target, args.target_fraction)
    figures = {label: mode_figures(group, means[label], target) for label, group in runs.items()}
    sync, async_ = (runs.get(mode.label) for mode in modes)
    buckets = equal_step_buckets(sync, async_) if sync and async_ else (None, {})
    print_table(figures, target, buckets)
    if not (sync and async_):
        print(f"run the other mode (--modes) with --out-dir {root} to compare them")
        return
    plot({label: [run["curve"] for run in group] for label, group in runs.items()}, means, target,
         root / "time_to_score.png")
    print(f"plot: {root / 'time_to_score.png'}")
    sync_figures, async_figures = figures[modes[0].label], figures[modes[1].label]
    ceiling = ceiling_figures(read_ceiling(root), sync_figures["trained_tokens_per_s"],
                              async_figures["trained_tokens_per_s"],
                              sync_figures["training_tokens_per_s"] if records.gpus == 1 else None)
    print_ceiling(ceiling)
    engines = ceiling_engines(root)
    if engines not in (None, modes[1].servers):
        print(f"the ceiling kept {engines} engine(s) full, the async job ran {modes[1].servers} server(s): measure it "
              "again (--modes ceiling) with the job's --async-servers")
    serving = async_figures["servers_serving"]
    if serving is not None and serving < modes[1].servers:
        print(f"the async job trained with {serving} of its {modes[1].servers} server(s) at some step (one failed to "
              "start, died or went silent: its logs say which): its figures are not that many servers'")
    per_seed = seed_speedups(sync, async_, args.target, args.target_fraction)
    print("time to score, each seed against its own target: "
          + ", ".join(f"seed {seed} {cell(speedup, 'x')}" for seed, speedup in per_seed.items()))
    same_start, same_host = modes_match(records.starts), modes_match(records.hosts)
    if same_start is False:
        print("the two modes of a seed started from different weights (prepared on different hosts?): "
              "start_models_match false")
    if same_host is False:
        print("the two modes of a seed ran on different hosts, whose pace can differ (same_host false): race them "
              "in one session")
    result = {
        "time_to_score_speedup": ratio(sync_figures["time_to_target_s"], async_figures["time_to_target_s"]),
        "seed_time_to_score_speedups": per_seed,
        "time_to_score_after_start_up_speedup": ratio(sync_figures["time_to_target_after_start_up_s"],
                                                      async_figures["time_to_target_after_start_up_s"]),
        "trained_tokens_speedup": ratio(async_figures["trained_tokens_per_s"], sync_figures["trained_tokens_per_s"]),
        "version_pace_speedup": ratio(sync_figures["time_per_version_s"], async_figures["time_per_version_s"]),
        "step_pace_speedup": ratio(sync_figures["time_per_step_s"], async_figures["time_per_step_s"]),
        **ceiling,
        "validations_skipped": records.skipped, "validations_unscored": records.unscored,
        "start_models_match": same_start, "same_host": same_host,
        "learner_share_of_sync_step": sync_figures["learner_share"],
        "sync_baseline": sync_baseline(records.gpus, root / modes[0].run_name(ran[modes[0]][0])),
        "gpus": records.gpus, "seeds": sorted(set(ran[modes[0]]) & set(ran[modes[1]])), "target": rounded(target, 3),
        "max_staleness": args.max_staleness, "async_servers": modes[1].servers, "ceiling_engines": engines,
        "steps": steps, "val_every": val_every,
        "equal_step_version": buckets[0], "buckets": buckets[1],
        "sync": sync_figures, "async": async_figures,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
