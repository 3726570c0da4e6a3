"""Per-task reward metrics: the mean reward of each data source, and the mean of each numeric entry its
reward function returned beside the score (verl's `reward_extra_info`, e.g. `acc`, `format`, or the terms
of a combined reward), named `<prefix>/<data_source>/<entry>/mean`."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping, NamedTuple

SCORE_ENTRY = "score"  # the reward itself, beside the entries of reward_info


class ScoredSample(NamedTuple):
    data_source: str  # task of the sample's prompt
    score: float  # its reward
    info: Mapping[str, float]  # the other numeric entries its reward function returned


def task_reward_metrics(samples: Iterable[ScoredSample], prefix: str) -> dict[str, float]:
    """`<prefix>/<task>/score/mean` per task, and `<prefix>/<task>/<entry>/mean` over the task's samples
    that carry the entry (a reward function may return an entry for some samples only)."""
    values: dict[tuple[str, str], list[float]] = defaultdict(list)
    for sample in samples:
        values[(sample.data_source, SCORE_ENTRY)].append(sample.score)
        for entry, value in sample.info.items():
            values[(sample.data_source, entry)].append(value)
    return {metric_name(prefix, task, entry): sum(found) / len(found) for (task, entry), found in sorted(values.items())}


def task_sample_counts(data_sources: Iterable[str]) -> dict[str, float]:
    """`batch/<task>/samples`: how many of a batch's samples each task holds (what the mixture drew)."""
    counts: dict[str, int] = defaultdict(int)
    for data_source in data_sources:
        counts[data_source] += 1
    return {f"batch/{task}/samples": float(count) for task, count in sorted(counts.items())}


def metric_name(prefix: str, task: str, entry: str = SCORE_ENTRY) -> str:
    """The name `task_reward_metrics` gives the mean of `entry` for `task`."""
    return f"{prefix}/{task}/{entry}/mean"
