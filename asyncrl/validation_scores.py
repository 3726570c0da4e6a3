"""Validation metrics from scored samples: mean reward and unbiased pass@k, overall and per data source, per data
source the mean of each numeric entry the reward function returned beside the score, and the mean reward per
bucket of response lengths.

pass@k is the chance that at least one of k samples drawn without replacement from a prompt's n samples
is correct, estimated without bias from the c correct ones (Chen et al., 2021, "Evaluating Large
Language Models Trained on Code"):  pass@k = 1 − C(n−c, k) / C(n, k), averaged over prompts.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import msgspec

from asyncrl.task_metrics import ScoredSample, task_reward_metrics

PREFIX = "val"  # every validation metric is named val/...
VERSION_KEY = "val/version"  # policy version a pass validated (logged with its metrics)
NOT_VALIDATED = -1  # validation version before the first pass
# A sample counts as correct for pass@k when its reward reaches this: the built-in scorers give 1.0 for a
# right answer and 0.0 otherwise; a partial-credit reward passes only with full marks.
CORRECT_MIN_SCORE = 1.0
OPEN_END = "inf"  # the upper end in the name of the last length bucket, which has none


@dataclass(frozen=True)
class PromptOutcome:
    """The scored samples of one held-out prompt."""

    data_source: str  # dataset of the prompt (per-source metrics)
    scores: list[float]  # reward of each of its n samples
    infos: list[Mapping[str, float]] = field(default_factory=list)  # each sample's other reward entries (empty: none)
    lengths: list[int] = field(default_factory=list)  # each sample's response tokens (the model's own in an episode)


def encode_outcomes(outcomes: Sequence[PromptOutcome]) -> bytes:
    """`outcomes` as msgpack, to pool a pass split among the ranks of one job (`decode_outcomes` reads them)."""
    return msgspec.msgpack.encode(list(outcomes))


def decode_outcomes(payload: bytes) -> list[PromptOutcome]:
    """The outcomes of `encode_outcomes`' bytes; msgspec.ValidationError names the field of a malformed one."""
    return msgspec.msgpack.decode(payload, type=list[PromptOutcome])


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `correct` of `n` samples right: 1 − C(n−c, k) / C(n, k)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= correct <= n:
        raise ValueError(f"correct samples must lie in [0, n={n}], got {correct}")
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def validation_metrics(outcomes: Sequence[PromptOutcome], k: int, length_buckets: Sequence[int] = ()) -> dict[str, float]:
    """`val/score/mean`, `val/pass@k` and `val/prompts` over all prompts, the same under `val/<data_source>/`
    for each data source, `val/<data_source>/<entry>/mean` for each entry of the samples' reward info, and
    the length buckets' metrics (`length_bucket_metrics`) when `length_buckets` are given."""
    by_source: dict[str, list[PromptOutcome]] = defaultdict(list)
    for outcome in outcomes:
        by_source[outcome.data_source].append(outcome)
    metrics = _summary(outcomes, k, PREFIX)
    for source, group in sorted(by_source.items()):
        metrics |= _summary(group, k, f"{PREFIX}/{source}")
    return metrics | task_reward_metrics(_scored_samples(outcomes), PREFIX) | length_bucket_metrics(outcomes, length_buckets)


def length_bucket_metrics(outcomes: Sequence[PromptOutcome], upper_ends: Sequence[int]) -> dict[str, float]:
    """`val/score/bucket/<lo>-<hi>`, the mean score of the samples whose response took lo..hi tokens, and
    `val/samples/bucket/<lo>-<hi>`, how many they are. The buckets end at `upper_ends` (increasing), the last one
    above them is `<lo>-inf`; a bucket without samples is left out. No `upper_ends`, no buckets."""
    if not upper_ends:
        return {}
    scores: dict[int, list[float]] = defaultdict(list)
    for outcome in outcomes:
        for score, length in zip(outcome.scores, outcome.lengths):
            scores[bisect.bisect_left(upper_ends, length)].append(score)
    metrics = {}
    for bucket, found in sorted(scores.items()):
        name = bucket_name(upper_ends, bucket)
        metrics |= {f"{PREFIX}/score/bucket/{name}": sum(found) / len(found), f"{PREFIX}/samples/bucket/{name}": float(len(found))}
    return metrics


def bucket_name(upper_ends: Sequence[int], bucket: int) -> str:
    """"<lo>-<hi>": the response lengths (tokens, both ends included) of bucket `bucket` of `upper_ends`."""
    low = upper_ends[bucket - 1] + 1 if bucket else 1
    high = str(upper_ends[bucket]) if bucket < len(upper_ends) else OPEN_END
    return f"{low}-{high}"


def _scored_samples(outcomes: Sequence[PromptOutcome]) -> list[ScoredSample]:
    return [ScoredSample(o.data_source, score, o.infos[index] if o.infos else {})
            for o in outcomes for index, score in enumerate(o.scores)]


def _summary(outcomes: Sequence[PromptOutcome], k: int, prefix: str) -> dict[str, float]:
    if not outcomes:
        return {}
    scores = [score for outcome in outcomes for score in outcome.scores]
    passes = [pass_at_k(len(o.scores), sum(s >= CORRECT_MIN_SCORE for s in o.scores), k) for o in outcomes]
    return {
        f"{prefix}/score/mean": sum(scores) / len(scores),
        f"{prefix}/pass@{k}": sum(passes) / len(passes),
        f"{prefix}/prompts": float(len(outcomes)),
    }
