"""The race's two jobs (`Mode`; the async job's servers: `servers_overrides`), its runs' records read back
(`read_runs`), and one run's figures read from its records (`summarise`): its curve of held-out scores against
wall-clock time, its token rates after the warm-up, its lengths and the learner's share of a step, and its due
versions left without a score (`missing_scores`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import AsyncRLConfig
from asyncrl.gpu_ids import visible_gpus
from asyncrl.metrics import read_metrics
from asyncrl.snapshots import due_versions, made_times, read_evaluation
from launch.tuning import fewest_servers
from scripts.race_figures import seconds_per_version
from scripts.run_records import LOG_READINGS, RUN_PREFIX, machine_of, read_launch

SCORE_KEY = "val/score/mean"
BUCKET_PREFIX = "val/score/bucket/"
GENERATED_MEAN_KEY = "response_length/generated_mean"  # the buffer's mean response length of what it stored
INGESTED_KEY = "buffer/ingested_response_tokens"  # response tokens the buffer has stored since the run began

Record = dict[str, Any]


@dataclass(frozen=True)
class Mode:
    """One of the two jobs."""

    name: str  # "sync" or "async"
    k: int  # buffer.max_staleness of the async job
    servers: int = 1  # the async job's rollout servers (--async-servers; on one GPU all beside the learner)
    overrides: tuple[str, ...] = ()  # the job's own config overrides, after the race's

    def run_name(self, seed: int) -> str:
        if self.name == "sync":
            return f"{RUN_PREFIX}sync-s{seed}"
        return f"{RUN_PREFIX}async-k{self.k}{self._servers('-{}srv')}-s{seed}"

    @property
    def label(self) -> str:
        return "sync" if self.name == "sync" else f"async K={self.k}{self._servers(', {} servers')}"

    def _servers(self, form: str) -> str:
        return form.format(self.servers) if self.servers > 1 else ""

    def warmup(self, warmup_steps: int) -> int:
        """Steps left out of the token rate: the async job's first step lets the server fill the buffer K + 1
        batches ahead, which the next K steps drain without waiting."""
        return warmup_steps if self.name == "sync" else max(warmup_steps, self.k + 1)


def servers_overrides(config: AsyncRLConfig, servers: int) -> tuple[str, ...]:
    """The async job's overrides for `servers` servers: the config's rollout.max_inflight (what the generation side
    runs at once) split among them, and CUDA graphs no larger than one server's part; none for one server."""
    if servers == 1:
        return ()
    each = math.ceil(config.rollout.max_inflight / servers)
    graphs = config.rollout.engine.cudagraph_max_sequences
    return (f"rollout.num_servers={servers}", f"rollout.max_inflight={each}",
            *([f"rollout.engine.cudagraph_max_sequences={each}"] if graphs > each else []))


def summarise(records: list[Record], made: dict[int, float], evaluation: dict[int, Record], launched: float,
              mode: Mode, warmup_steps: int) -> dict[str, Any]:
    """One run's figures: its curve, throughput, lengths and learner share."""
    steps = {r["step"]: r for r in records if "batch/samples" in r}
    numbers = sorted(steps)
    clock = {n: steps[n]["time"] - launched for n in numbers}
    start, last = mode.warmup(warmup_steps), numbers[-1]
    timed = [steps[n] for n in numbers if start < n <= last]
    trained_mean = sum(map(trained_tokens, steps.values())) / sum(r["batch/samples"] for r in steps.values())
    generated_mean = trained_mean if mode.name == "sync" else steps[last].get(GENERATED_MEAN_KEY)
    trained = sum(map(trained_tokens, timed))
    trained_rate = trained / (clock[last] - clock[start])
    curve = [(v, made[v] - launched, evaluation[v][SCORE_KEY]) for v in sorted(evaluation) if v in made]
    return {
        "steps": last, "first_record_s": clock[numbers[0]], "last_record_s": clock[last],
        "time_per_step_s": (clock[last] - clock[start]) / (last - start),  # wall seconds a learner step, after warm-up
        "trained_tokens_per_s": trained_rate,
        "generated_tokens_per_s": trained_rate if mode.name == "sync" else intake_rate(steps[start], steps[last]),
        "training_tokens_per_s": trained / sum(r["timing_s/train"] for r in timed),
        "trained_length_mean": trained_mean, "generated_length_mean": generated_mean,
        "length_ratio": trained_mean / generated_mean if generated_mean else None,
        "learner_share": statistics.fmean(r["timing_s/train"] / r["timing_s/step"] for r in timed),
        "servers_serving": fewest_servers(timed),  # the async job's, against its --async-servers (sync has none)
        "curve": curve, "time_per_version_s": seconds_per_version(curve),
        "buckets": {v: bucket_scores(record) for v, record in evaluation.items()},
    }


@dataclass
class RaceRecords:
    """What the race's records in its directory hold, read back."""

    runs: dict[str, list[dict[str, Any]]]  # mode label -> each seed's summary
    skipped: int  # due validations never scored (no snapshot, or its scoring failed), over every run
    unscored: int  # due validations whose snapshot a --no-evaluate call left unscored, over every run
    gpus: int  # where the runs ran (a report may run elsewhere)
    starts: dict[int, dict[str, str | None]]  # seed -> mode name -> digest of the weights it started from
    hosts: dict[int, dict[str, str | None]]  # seed -> mode name -> the machine it ran on (None: not recorded)


def read_runs(root: Path, modes: list[Mode], ran: dict[Mode, list[int]], steps: int, val_every: int, scoring: bool,
              warmup_steps: int) -> RaceRecords:
    """The records of the runs `ran` (mode -> its seeds) in `root`: each run's figures (`summarise`, its first
    `warmup_steps` untimed), the due validations of `val_every` over each run's own steps (its launch record's;
    `steps` where an older record lacks them) left without a score (`missing_scores`; `scoring`: whether this call
    scores them), and where each ran and what it started from."""
    records = RaceRecords({}, 0, 0, len(visible_gpus()), {}, {})
    for mode in modes:
        for seed in ran[mode]:
            directory = root / mode.run_name(seed)
            launch = read_launch(root, mode.run_name(seed))
            evaluation, made = read_evaluation(directory), made_times(directory)
            run_steps = launch.get("steps", steps)  # a pace's sync runs half as many; records before: the call's
            skipped, unscored = missing_scores(evaluation, made, val_every, run_steps, scoring=scoring)
            records.skipped, records.unscored = records.skipped + skipped, records.unscored + unscored
            records.gpus = launch.get("gpus", records.gpus)
            records.starts.setdefault(seed, {})[mode.name] = launch.get("start_weights")
            records.hosts.setdefault(seed, {})[mode.name] = machine_of(launch)
            run = summarise(read_metrics(directory), made, evaluation, launch["time"], mode, warmup_steps)
            records.runs.setdefault(mode.label, []).append(
                run | {"seed": seed} | {key: launch.get(key) for key in LOG_READINGS})
    return records


def intake_rate(first: Record, last: Record) -> float | None:
    """Response tokens the buffer stored per second between two steps' records (None where they lack the count):
    beside the trained rate of the same steps, it tells a pace the servers kept up from one that drained a backlog."""
    if INGESTED_KEY not in first or INGESTED_KEY not in last:
        return None
    return (last[INGESTED_KEY] - first[INGESTED_KEY]) / (last["time"] - first["time"])


def trained_tokens(step: Record) -> float:
    return step["batch/samples"] * step["response_length/mean"]


def bucket_scores(record: Record) -> dict[str, float]:
    return {key[len(BUCKET_PREFIX):]: value for key, value in record.items() if key.startswith(BUCKET_PREFIX)}


def missing_scores(evaluation: dict[int, Record], made: dict[int, float], every: int, steps: int,
                   scoring: bool) -> tuple[int, int]:
    """A run's due versions with no score, as (skipped, unscored): skipped were never validated (no snapshot made,
    or its scoring failed); unscored have a snapshot whose scoring this call left for later (--no-evaluate), so that
    a throughput pass does not read as validations lost."""
    missing = [version for version in due_versions(every, steps) if version not in evaluation]
    unscored = 0 if scoring else sum(1 for version in missing if version in made)
    return len(missing) - unscored, unscored
