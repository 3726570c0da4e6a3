"""The learner's share of a synchronous step, per model shape and batch size, on a task's own response lengths and
before any model is warm-started: which preset makes training the part of a step it is in LLM RL (25-50 %).

Each candidate is the config with overrides: the config as it is first (unless --without-config), then each
--candidate, e.g. "model.tiny.hidden_size=1536 model.tiny.num_layers=24 model.tiny.intermediate_size=4096":
  1. a tiny-family model of the candidate's shape (`model.tiny`) with random weights, under --work-dir;
  2. the task's training problems as data rows, each capped (its extra_info's `max_tokens`) at the length of the
     teacher's worked response to it and sampled with EOS ignored (`rollout.sampling.ignore_eos`): each response is as
     long as the task's answer to its prompt, as a warm-started policy writes it (the race's synchronous run wrote
     195 tokens on the mean, the teacher 188), whatever random weights sample;
  3. the product's synchronous job on them (`asyncrl run learner.mode=synchronous`: the engine, the reward workers, the
     trainer, the weight loads; validation off) for --steps steps;
  4. from its metrics, each step's generation (`timing_s/wait_batch`: sampling and scoring the batch), training
     (`timing_s/train`) and whole step, the first --skip steps left out (first calls' warm-up). Every sample the job
     trained (`trained/step_N.msgpack`) is checked to be as long as its cap: a run that sampled other lengths is an
     error, not a figure.
The share is training's part of a step (`timing_s/train` / `timing_s/step`, the race's `learner_share`). After each
candidate's job, the table of those measured so far (a call cut short keeps them): the parameters, prompts x samples,
trained response tokens per step, the median generation, training and step seconds, the share, trained tokens/s, and
the generation and training time against the first candidate's.
Each candidate's engine compiles its model's graphs at its first start on a host (about a minute on an H200); the
steps do not see it. Run with scripts/cpu_env.sh sourced on CPU.
Last line: RESULT {json} with each candidate's overrides and figures.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import AsyncRLConfig, ConfigError, load_config
from asyncrl.config_arguments import add_config_arguments
from asyncrl.data import encode_prompt, load_prompt_file, write_rows
from asyncrl.data.rows import ROW_MAX_TOKENS_KEY
from asyncrl.gpu_ids import visible_gpus
from asyncrl.metrics import read_metrics
from asyncrl.thinking import Thinking

RUN_NAME = "share"
JOB_TIMEOUT_S = 3600  # one candidate's job, its engine's first compile included

Record = dict[str, Any]


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # on the config and the command line's overrides

    @property
    def label(self) -> str:
        return " ".join(self.overrides) or "the config"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "configs/gpu_longtail.yaml", "config overrides for every candidate")
    parser.add_argument("--candidate", action="append", default=[], metavar="OVERRIDES",
                        help="one candidate: config overrides in one quoted argument, on top of the config; repeat "
                             "for more (the config as it is is always the first)")
    parser.add_argument("--without-config", action="store_true",
                        help="leave the config as it is out (an earlier call measured it); the ratios are then against "
                             "the first --candidate")
    parser.add_argument("--steps", type=int, default=8, help="synchronous steps per candidate")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the figures (warm-up)")
    parser.add_argument("--work-dir", default="", help="models, data and runs (default: a new temporary directory); "
                                                       "each model is deleted once its job has run")
    args = parser.parse_args()
    if args.skip < 0 or args.steps <= args.skip:
        parser.error("--steps must be above --skip (at least one step is timed)")
    args.candidates = ([] if args.without_config else [Candidate(())]) + [Candidate(tuple(shlex.split(text)))
                                                                          for text in args.candidate]
    if not args.candidates:
        parser.error("--without-config needs at least one --candidate")
    for candidate in args.candidates:
        try:
            load_config(args.config, [*args.overrides, *candidate.overrides])
        except ConfigError as error:
            parser.error(f"candidate '{candidate.label}': {error}")
    return args


def job_overrides(place: Path, steps: int) -> list[str]:
    """The synchronous job of one candidate, everything under `place`: its random model, its capped rows, its run."""
    return [f"model.path={place / 'model'}", f"data.train_files=[{place / 'train.parquet'}]",
            f"run.root_dir={place / 'runs'}", f"run.name={RUN_NAME}", "learner.mode=synchronous",
            f"learner.total_steps={steps}", f"learner.checkpoint_every={steps + 1}", "validation.every=0",
            "validation.after_run=false", "rollout.sampling.ignore_eos=true", "metrics.wandb_mode=disabled"]


def save_random_model(config: AsyncRLConfig) -> int:
    """A tiny-family model of `model.tiny`'s shape with random weights (seeded by `run.seed`), at `model.path`; its
    parameter count."""
    from demo.tiny.model import build_tiny_model
    from demo.tiny.vocabulary import build_tokenizer

    tokenizer = build_tokenizer(config.model.tiny.tokenizer)
    model = build_tiny_model(config.model.tiny, tokenizer, config.run.seed)
    model.save_pretrained(config.model.path)
    tokenizer.save_pretrained(config.model.path)
    return sum(parameter.numel() for parameter in model.parameters())


def write_capped_rows(config: AsyncRLConfig) -> dict[tuple[int, ...], int]:
    """The task's training rows, each capped at its teacher's response length (EOS included), written to the job's
    training file; the cap of each prompt as the job encodes it (its token ids), at most `rollout.sampling.max_tokens`."""
    from demo.tasks.catalog import SingleTurn, task_kind
    from transformers import AutoTokenizer

    kind = task_kind(config.task)
    if not isinstance(kind.teacher, SingleTurn):
        raise SystemExit(f"task.name={config.task.name}: a multi-turn task has no one response length per prompt")
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    rows = []
    for index, problem in enumerate(kind.split(config.task, config.run.seed).train):
        response = kind.teacher.response(problem, 0.0, random.Random(index))  # no label noise: the right answer
        row = kind.make_row(problem, index, "train", config.task)
        length = len(tokenizer.encode(response, add_special_tokens=False)) + 1  # and the end-of-sequence token
        rows.append(row | {"extra_info": {**row.get("extra_info", {}), ROW_MAX_TOKENS_KEY: length}})
    (path,) = config.data.train_files
    write_rows(rows, path)
    thinking = Thinking.for_tokenizer(config.rollout.thinking, tokenizer)
    return {tuple(encode_prompt(tokenizer, row, thinking)): min(row.extra_info[ROW_MAX_TOKENS_KEY],
                                                                   config.rollout.sampling.max_tokens)
            for row in load_prompt_file(path)}


def run_job(args: argparse.Namespace, overrides: list[str], config: AsyncRLConfig) -> Path:
    """The candidate's synchronous job (`config`, from `overrides`), its progress on this console; its run directory."""
    command = [sys.executable, "-m", "launch", "run", "--config", args.config, *overrides]
    done = subprocess.run(command, timeout=JOB_TIMEOUT_S)
    run_dir = Path(config.run.root_dir) / RUN_NAME
    if done.returncode != 0:
        raise SystemExit(f"the synchronous job exited with code {done.returncode}: see {run_dir / 'logs'}")
    return run_dir


def check_lengths(run_dir: Path, steps: int, caps: dict[tuple[int, ...], int]) -> None:
    """Every trained sample is as long as its prompt's cap; SystemExit naming the first that is not."""
    from launch.reference_loop import trained_groups

    for step in range(1, steps + 1):
        for group in trained_groups(run_dir, step):
            for sample in group.trajectories:
                wanted = caps.get(tuple(sample.prompt_ids))
                if wanted != len(sample.completion_ids):
                    raise SystemExit(f"step {step}, group {group.group_id}: a response of {len(sample.completion_ids)} "
                                     f"tokens where its prompt's cap is {wanted} (finish reason {sample.finish_reason}): "
                                     "the lengths are not the task's, no share is measured")


def step_figures(records: list[Record], skip: int) -> dict[str, float]:
    """Medians of the timed steps' generation, training and step seconds; the mean share and tokens per step; the
    trained tokens/s over them."""
    timed = [record for record in records if "timing_s/train" in record and record["step"] > skip]
    tokens = [record["batch/samples"] * record["response_length/mean"] for record in timed]
    return {
        "steps_timed": len(timed),
        "tokens_per_step": round(statistics.fmean(tokens), 1),
        "generation_s": round(statistics.median(r["timing_s/wait_batch"] for r in timed), 3),
        "training_s": round(statistics.median(r["timing_s/train"] for r in timed), 3),
        "step_s": round(statistics.median(r["timing_s/step"] for r in timed), 3),
        "learner_share": round(statistics.fmean(r["timing_s/train"] / r["timing_s/step"] for r in timed), 4),
        "trained_tokens_per_s": round(sum(tokens) / sum(r["timing_s/step"] for r in timed), 1),
    }


def measure(args: argparse.Namespace, candidate: Candidate, place: Path) -> dict[str, Any]:
    """One candidate's model, rows and job; its figures."""
    shutil.rmtree(place, ignore_errors=True)  # an earlier call's run there would be resumed, not run afresh
    overrides = [*args.overrides, *candidate.overrides, *job_overrides(place, args.steps)]
    config = load_config(args.config, overrides)
    params = save_random_model(config)
    caps = write_capped_rows(config)
    run_dir = run_job(args, overrides, config)
    shutil.rmtree(config.model.path, ignore_errors=True)  # a billion-parameter candidate's is gigabytes
    check_lengths(run_dir, args.steps, caps)
    return {"overrides": list(candidate.overrides), "params": params, "prompts": config.buffer.batch_groups,
            "samples_per_prompt": config.rollout.sampling.n, **step_figures(read_metrics(run_dir), args.skip)}


HEADER = (f"{'params M':>9} {'prompts x n':>11} {'tokens/step':>11} {'gen s':>7} {'train s':>8} {'step s':>7} "
          f"{'share':>6} {'tok/s':>8} {'gen vs 1st':>10} {'train vs 1st':>12}  candidate")


def table_row(row: dict[str, Any], first: dict[str, Any]) -> str:
    return (f"{row['params'] / 1e6:>9.1f} {row['prompts']:>6} x {row['samples_per_prompt']:<2} "
            f"{row['tokens_per_step']:>11.0f} {row['generation_s']:>7.3f} {row['training_s']:>8.3f} "
            f"{row['step_s']:>7.3f} {row['learner_share']:>6.1%} {row['trained_tokens_per_s']:>8.0f} "
            f"{row['generation_s'] / first['generation_s']:>9.2f}x {row['training_s'] / first['training_s']:>11.2f}x  "
            f"{' '.join(row['overrides']) or 'the config'}")


def main() -> None:
    args = parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="asyncrl-share-"))
    figures: list[dict[str, Any]] = []
    for index, candidate in enumerate(args.candidates):
        print(f"candidate {index + 1}/{len(args.candidates)}: {candidate.label}", flush=True)
        figures.append(measure(args, candidate, work / f"candidate{index}"))
        # the rows so far after each job: a call cut short by a host's time limit keeps what it measured
        print("\n".join([HEADER, *(table_row(row, figures[0]) for row in figures)]), flush=True)
    result = {"config": args.config, "overrides": args.overrides, "steps": args.steps, "skip": args.skip,
              "gpus": len(visible_gpus()), "candidates": figures}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
