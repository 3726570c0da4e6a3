"""`asyncrl tune`'s GPU split: on a host of G GPUs, how many should run rollout servers and how many learner ranks
so that neither side waits for the other, predicted from the run's own rates (docs/tuning.md, "Which GPU split").

The run gives two rates, both in completion tokens (what the servers sample and the learner trains): what one
rollout server on GPUs of its own generates per second while it has work (`rollout/server-N/tokens_per_s` over the
share of its time it was not idle, `rollout/server-N/idle_ratio`), and what one learner rank trains per second of
training (`learner/tokens_per_s`, which is per second of `timing_s/train`, shared among the ranks). With s servers
and l ranks (s × tensor-parallel size + l = G), generation supplies s × the first, training consumes l × the second,
and the job runs at the smaller of the two. That the learner scales linearly with its ranks is an assumption: one
run shows one size. A run whose learner shared its GPU with every server has no split to predict from: the two
sides shared that GPU's time, and neither rate is what a GPU of its own gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from asyncrl.config import AsyncRLConfig
from asyncrl.placement import listed_plan
from launch.tuning import mean_of

MIN_STEPS = 5  # read steps that logged both sides' rates: fewer swing with a few batches' lengths
MIN_BUSY = 0.05  # a server busy less than this share of its time gives no busy rate worth scaling up
LEARNER_RATE = "learner/tokens_per_s"  # trained completion tokens per second of timing_s/train, whole learner
TRAIN_S = "timing_s/train"
GPU_MEMORY = "memory/peak_gib"  # logged on a GPU only: a run without lists that logged it had GPUs


class NoSplit(ValueError):
    """The run cannot say which split to try; the message says why."""


@dataclass(frozen=True)
class RunPlacement:
    """Where the run's roles ran, from the GPU lists its config.yaml keeps."""

    gpus: int  # distinct GPUs the run used
    apart: tuple[int, ...]  # indices of the servers on GPUs of their own
    beside: int  # servers on the learner's GPU
    ranks: int  # learner ranks, a GPU each
    tensor_parallel: int  # GPUs per server

    @classmethod
    def of(cls, config: AsyncRLConfig, steps: Sequence[Mapping[str, Any]]) -> RunPlacement:
        plan = listed_plan(config)
        if not plan.learner or not plan.servers:
            raise NoSplit(_unlisted(steps))
        if plan.sharing == len(plan.servers):
            raise NoSplit(f"the learner shared its GPU with every server ({plan.describe()}): the two sides shared its "
                          "time, so no split between them applies")
        return cls(len(set(plan.learner) | set(plan.server_gpus)),
                   tuple(index for index in range(len(plan.servers)) if not plan.shares(index)), plan.sharing,
                   len(plan.learner), config.rollout.engine.tensor_parallel_size)

    def describe(self) -> str:
        beside = f" (and {_count(self.beside, 'server')} beside the learner)" if self.beside else ""
        gpus = f" of {self.tensor_parallel} GPUs" if self.tensor_parallel > 1 else ""
        return (f"{_count(len(self.apart), 'server')}{gpus} on GPUs of their own{beside} and "
                f"{_count(self.ranks, 'learner rank')} on {self.gpus} GPUs")


@dataclass(frozen=True)
class Rates:
    """Each side's rate per unit, read over the steps after the warm-up."""

    steps: int  # steps read that logged both sides' rates
    delivered: float  # tokens/s a server on GPUs of its own generated, idle time included
    idle: float  # share of its time such a server had nothing in its engine
    trained: float  # tokens/s the whole learner trained per second of training
    ranks: int  # the learner ranks that trained them

    @property
    def generation(self) -> float:
        """Tokens/s one server generates while it has work."""
        return self.delivered / (1 - self.idle)

    @property
    def training(self) -> float:
        """Tokens/s one learner rank trains while it trains."""
        return self.trained / self.ranks


@dataclass(frozen=True)
class Split:
    """s servers and l learner ranks, with what each side would do at the run's rates."""

    servers: int
    ranks: int
    generation: float  # tokens/s the servers supply
    training: float  # tokens/s the ranks train

    @property
    def job(self) -> float:
        return min(self.generation, self.training)

    @property
    def servers_idle(self) -> float:
        return 1 - self.job / self.generation

    @property
    def learner_waits(self) -> float:
        return 1 - self.job / self.training

    def describe(self, beside: int) -> str:
        """The split, with the keys that give it under `asyncrl run` on that many GPUs (`rollout.placement=auto` puts
        the servers GPUs of their own cannot hold beside the learner: the run's `beside` ones stay there)."""
        kept = f", {_count(beside, 'server')} of them beside the learner as in the run" if beside else ""
        return (f"{_count(self.servers, 'server')} + {_count(self.ranks, 'learner rank')} (rollout.num_servers="
                f"{self.servers + beside} learner.nproc={self.ranks}{kept})")


def split_advice(steps: Sequence[Mapping[str, Any]], config: AsyncRLConfig, gpus: int | None = None) -> list[str]:
    """The split to try on the run's GPUs (or on `gpus`), the numbers it came from and the table of every split; one
    line saying why where the run cannot tell. `steps`: the step records after the warm-up (`launch.tuning.read_steps`)."""
    try:
        placement = RunPlacement.of(config, steps)
        rates = read_rates(steps, placement)
        host = gpus or placement.gpus
        candidates = splits(rates, placement, host)
    except NoSplit as reason:
        return [f"split: {reason}"]
    run = _run_split(candidates, placement, host)
    best = max(candidates, key=lambda split: (split.job, split == run))  # a tie keeps the run's split
    return [_headline(best, run, host, placement.beside), _read_line(rates, placement), _model_line(rates),
            *_table(candidates, best, run)]


def read_rates(steps: Sequence[Mapping[str, Any]], placement: RunPlacement) -> Rates:
    """Both sides' rates over the steps that logged them; NoSplit when the run lacks them, is too short, or its servers
    were too idle to show their busy rate."""
    keys = [f"rollout/server-{index}/{name}" for index in placement.apart for name in ("tokens_per_s", "idle_ratio")]
    keys += [LEARNER_RATE, TRAIN_S]
    missing = [key for key in keys if not any(step.get(key) is not None for step in steps)]
    if missing:
        raise NoSplit(f"the run logged no {', '.join(missing)}: it lacks the rates a split is predicted from")
    read = [step for step in steps if all(step.get(key) is not None for key in keys)]
    if len(read) < MIN_STEPS:
        raise NoSplit(f"{_count(len(read), 'step')} after the warm-up logged both sides' rates, and a split needs "
                      f"{MIN_STEPS}: the run is too short to tell")
    idle = sum(mean_of(read, f"rollout/server-{index}/idle_ratio") for index in placement.apart) / len(placement.apart)
    if 1 - idle < MIN_BUSY:
        raise NoSplit(f"the servers on GPUs of their own were idle {idle:.0%} of their time: too little work to show "
                      "what one generates when busy")
    delivered = sum(mean_of(read, f"rollout/server-{index}/tokens_per_s") for index in placement.apart)
    trained = sum(step[LEARNER_RATE] * step[TRAIN_S] for step in read) / max(sum(step[TRAIN_S] for step in read), 1e-9)
    if min(delivered, trained) <= 0:
        raise NoSplit(f"the servers generated {delivered:,.0f} tokens/s and the learner trained {trained:,.0f}: a side "
                      "that made no tokens gives no rate to scale")
    return Rates(len(read), delivered / len(placement.apart), idle, trained, placement.ranks)


def splits(rates: Rates, placement: RunPlacement, gpus: int) -> list[Split]:
    """Every split of `gpus` into servers (tensor-parallel size GPUs each) and learner ranks, at least one of each."""
    tp = placement.tensor_parallel
    # linear data-parallel scaling, assumed: l ranks train l × what one did
    candidates = [Split(servers, gpus - servers * tp, servers * rates.generation, (gpus - servers * tp) * rates.training)
                  for servers in range(1, (gpus - 1) // tp + 1)]
    if not candidates:
        raise NoSplit(f"{_count(gpus, 'GPU')} cannot hold a server of {_count(tp, 'GPU')} and a learner rank on a GPU "
                      "of its own")
    return candidates


def _run_split(candidates: list[Split], placement: RunPlacement, gpus: int) -> Split | None:
    """The run's own split among `candidates`: None on another host size (or where its servers shared GPUs)."""
    if gpus != placement.gpus:
        return None
    return next((split for split in candidates if split.servers == len(placement.apart)), None)


def _headline(best: Split, run: Split | None, gpus: int, beside: int) -> str:
    at = f"the job at {best.job:,.0f} tokens/s, {_slower_side(best)}"
    if run is None:
        return f"split: on {gpus} GPUs, {best.describe(beside)}: {at}"
    if best == run:
        return f"split: keep {best.describe(beside)} on the {gpus} GPUs: no other split is faster at the run's rates ({at})"
    return (f"split: {best.describe(beside)} on the {gpus} GPUs instead of the run's {run.servers} + {run.ranks}: {at}, "
            f"{best.job / run.job:.2f}x the {run.job:,.0f} predicted for the run's split")


def _slower_side(split: Split) -> str:
    if split.generation == split.training:
        return "both sides matched"
    return "generation the slower side" if split.generation < split.training else "training the slower side"


def _read_line(rates: Rates, placement: RunPlacement) -> str:
    beside = _count(placement.beside, "server")
    shared = f"; its learner shared a GPU with {beside}, so a rank of its own may train faster" if placement.beside else ""
    return (f"  read over {rates.steps} steps: {placement.describe()}; a server generated {rates.generation:,.0f} "
            f"tokens/s while busy ({rates.delivered:,.0f} delivered, idle {rates.idle:.0%}: rollout/server-N/"
            f"tokens_per_s and idle_ratio), a learner rank trained {rates.training:,.0f} tokens/s "
            f"while training ({LEARNER_RATE} {rates.trained:,.0f} over {_count(placement.ranks, 'rank')}){shared}")


def _model_line(rates: Rates) -> str:
    return (f"  model: s servers generate s × {rates.generation:,.0f} tokens/s, l learner ranks train l × "
            f"{rates.training:,.0f} (linear data-parallel scaling, assumed: one run shows one learner "
            "size), and the job runs at the smaller")


def _table(candidates: list[Split], best: Split, run: Split | None) -> list[str]:
    rows = ["  servers  ranks  generation tok/s  training tok/s  job tok/s  servers idle  learner waits"]
    for split in candidates:
        mark = ", ".join(name for name, chosen in (("best", split == best), ("run", split == run)) if chosen)
        rows.append(f"  {split.servers:>7}  {split.ranks:>5}  {split.generation:>16,.0f}  {split.training:>14,.0f}  "
                    f"{split.job:>9,.0f}  {split.servers_idle:>12.0%}  {split.learner_waits:>13.0%}"
                    + (f"  ← {mark}" if mark else ""))
    return rows


def _unlisted(steps: Sequence[Mapping[str, Any]]) -> str:
    """Why a run without GPU lists gives no split."""
    if not any(step.get(GPU_MEMORY) is not None for step in steps):
        return "the learner ran on the CPU: no GPU split applies"
    return ("the run's config.yaml names no GPUs (learner.gpus, rollout.gpus: roles started alone without them, under "
            "torchrun or on Ray): which GPUs each side had is unknown")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")
