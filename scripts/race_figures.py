"""The race to a score's figures across runs, from each run's summary (`race_runs.summarise`): the seeds'
mean curve, the target, the time to it (pooled and per seed), the length buckets at equal steps, each mode's part
of RESULT, the ceiling's figures and whether each seed's modes started from the same weights."""

from __future__ import annotations

import math
import statistics
from typing import Any

Curve = list[tuple[int, float, float]]  # (version, seconds since launch it was made, held-out score)


def mean_curve(curves: list[Curve]) -> Curve:
    """Per version every seed scored: the seeds' mean made-at time and mean score."""
    by_seed = [{version: (made, score) for version, made, score in curve} for curve in curves]
    common = sorted(set.intersection(*(set(points) for points in by_seed))) if by_seed else []
    return [(v, statistics.fmean(p[v][0] for p in by_seed), statistics.fmean(p[v][1] for p in by_seed)) for v in common]


def pick_target(curves: list[Curve], target: float | None, fraction: float) -> float | None:
    """`target`, or `fraction` of the way from the start score (version 0's, the lower) to the lower of the modes'
    best mean scores; None when a mode never rose above the start (nothing to race to)."""
    if target is not None:
        return target
    starts = [curve[0][2] for curve in curves if curve and curve[0][0] == 0]
    bests = [max(score for _, _, score in curve) for curve in curves if curve]
    if len(bests) < len(curves) or not starts or min(bests) <= min(starts):
        return None
    return min(starts) + fraction * (min(bests) - min(starts))


def time_to_target(curve: Curve, target: float | None) -> tuple[int, float] | tuple[None, None]:
    """(version, seconds) of the first version at or above `target`; (None, None) if none."""
    if target is not None:
        for version, made, score in curve:
            if score >= target:
                return version, made
    return None, None


def seconds_per_version(curve: Curve) -> float | None:
    """Wall-clock seconds a version took from the first scored version to the last: the run's pace, apart from its
    start-up and from where one noisy score happens to cross the target; None with fewer than two versions."""
    if len(curve) < 2 or curve[-1][0] == curve[0][0]:
        return None
    return (curve[-1][1] - curve[0][1]) / (curve[-1][0] - curve[0][0])


def seed_speedups(sync: list[dict[str, Any]], async_: list[dict[str, Any]], target: float | None,
                  fraction: float) -> dict[str, float | None]:
    """Each seed's own race, by seed: its target from its two curves alone (`pick_target`), sync's time to it over
    async's. Seeds start and level off apart, so one pooled target can sit above a seed's whole curve."""
    async_curves = {run["seed"]: run["curve"] for run in async_}
    speedups = {}
    for run in sync:
        if run["seed"] in async_curves:
            pair = [run["curve"], async_curves[run["seed"]]]
            own = pick_target(pair, target, fraction)
            speedups[str(run["seed"])] = ratio(time_to_target(pair[0], own)[1], time_to_target(pair[1], own)[1])
    return speedups


def equal_step_buckets(sync: list[dict[str, Any]], async_: list[dict[str, Any]]) -> tuple[int | None, dict[str, dict[str, float]]]:
    """The last version every run validated, and each length bucket's mean held-out score there per mode."""
    runs = sync + async_
    common = sorted(set.intersection(*(set(run["buckets"]) for run in runs)))
    if not common:
        return None, {}
    version = common[-1]
    names = sorted(set.intersection(*(set(run["buckets"][version]) for run in runs)), key=bucket_low)
    return version, {name: {label: statistics.fmean(run["buckets"][version][name] for run in group)
                            for label, group in (("sync", sync), ("async", async_))} for name in names}


def bucket_low(name: str) -> int:
    """The lower end of a bucket name "<lo>-<hi>", its order."""
    return int(name.split("-")[0])


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference to 3 decimals; None when either is missing or the reference is 0."""
    return round(value / reference, 3) if value is not None and reference else None


def mode_figures(runs: list[dict[str, Any]], curve: Curve, target: float | None) -> dict[str, Any]:
    """The per-mode part of RESULT: the seeds' means (and the final score's spread), the mean curve's time to the
    target, each seed's curve."""
    version, seconds = time_to_target(curve, target)
    start_up = curve[0][1] if curve and curve[0][0] == 0 else None  # the launch to version 0: the job's start-up
    finals = [run["curve"][-1][2] for run in runs if run["curve"]]

    def mean(key: str, digits: int = 1) -> float | None:
        # engine_start_s, engine_begins_s, cpu_*_share: not in older records; time_per_version_s: None below two versions
        values = [run[key] for run in runs if run.get(key) is not None]
        return rounded(statistics.fmean(values), digits) if values else None

    return {"time_to_target_s": rounded(seconds), "version_at_target": version, "start_up_s": rounded(start_up),
            "engine_begins_s": mean("engine_begins_s"), "engine_start_s": mean("engine_start_s"),
            "time_to_target_after_start_up_s": rounded(seconds - start_up) if None not in (seconds, start_up) else None,
            "time_per_version_s": mean("time_per_version_s", 3),
            "time_per_step_s": mean("time_per_step_s", 3),
            "seed_times_to_target_s": [rounded(time_to_target(run["curve"], target)[1]) for run in runs],
            "trained_tokens_per_s": mean("trained_tokens_per_s"),
            "generated_tokens_per_s": mean("generated_tokens_per_s"),  # what the servers stored over those steps
            "training_tokens_per_s": mean("training_tokens_per_s"),  # per second spent training
            "trained_length_mean": mean("trained_length_mean"),
            "generated_length_mean": mean("generated_length_mean"), "length_ratio": mean("length_ratio", 3),
            "learner_share": mean("learner_share", 3),
            "cpu_busy_share": mean("cpu_busy_share", 3), "cpu_steal_share": mean("cpu_steal_share", 3),  # the host's
            "start_score": rounded(curve[0][2], 3) if curve else None,
            "best_score": rounded(max((s for _, _, s in curve), default=None), 3),
            "final_score": rounded(statistics.fmean(finals), 3) if finals else None,
            "final_score_sd": rounded(statistics.stdev(finals), 3) if len(finals) > 1 else None,
            "last_record_s": mean("last_record_s"), "steps": runs[0]["steps"],
            "runs_under_mps": sum(bool(run.get("under_mps")) for run in runs),  # roles sharing a GPU at once
            "servers_serving": min((run["servers_serving"] for run in runs if run.get("servers_serving") is not None),
                                   default=None),  # the fewest over every seed's timed steps
            "curves": [[[v, rounded(t), rounded(s, 4)] for v, t, s in run["curve"]] for run in runs]}


def ceiling_figures(ceiling: float | None, sync_rate: float | None, async_rate: float | None,
                    sync_training_rate: float | None = None) -> dict[str, Any]:
    """The engine kept full against the two modes' trained tokens/s: how much any async job on these GPUs could
    gain over sync (`ceiling_speedup`), and how much of it this one reached (`async_share_of_ceiling`).

    On one GPU, given sync's tokens per second of training (`sync_training_rate`), also the rate of generation at
    the ceiling and training at sync's rate taking turns on the GPU, each token generated then trained
    (`turns_tokens_per_s`): where the learner's share is large the ceiling, which counts training as hidden, is out of
    reach of a job whose two sides share one GPU; above `turns` a job overlaps them, below it, it loses time to
    something else (waits, weight loads, a tail)."""
    turns = (1 / (1 / ceiling + 1 / sync_training_rate)
             if ceiling and sync_training_rate else None)  # [tokens/s]: a token's generation then its training
    return {"ceiling_tokens_per_s": ceiling, "ceiling_speedup": ratio(ceiling, sync_rate),
            "async_share_of_ceiling": ratio(async_rate, ceiling), "turns_tokens_per_s": rounded(turns),
            "turns_speedup": ratio(turns, sync_rate), "async_share_of_turns": ratio(async_rate, turns)}


def modes_match(per_seed: dict[int, dict[str, str | None]]) -> bool | None:
    """Whether each seed's two runs share a value (`per_seed`: seed -> mode -> value; the digest of the weights each
    started from, the host it ran on): False where any seed's differ, None where a value is missing (a record made
    before it was kept) or no seed ran both, else True. Modes prepared on different hosts share a start only if the
    warm start made the same weights on both."""
    pairs = [(runs.get("sync"), runs.get("async")) for runs in per_seed.values() if len(runs) == 2]
    if not pairs:
        return None
    if any(None not in pair and pair[0] != pair[1] for pair in pairs):
        return False
    return None if any(None in pair for pair in pairs) else True


def rounded(value: float | None, digits: int = 1) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)
