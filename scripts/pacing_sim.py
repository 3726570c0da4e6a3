"""Discrete-event replay of an async job on the two-GPU host, to compare fixed staleness bounds K with the
pacing controller (`buffer.max_staleness=auto`), which runs here as the real `learner.services.pacing.Pacer`.

What is replayed (docs/history/benchmarks-2026-11.md, seventh GPU session: two H200s, 0.5B shape, one server on GPU 0, the
learner on GPU 1, 16 groups x 8 samples per step, per-sample lengths geometric with median 192 and a 1,024
cap, `rollout.max_inflight=256`):
- the learner trains a batch in TRAIN_S = 2.16 s: the sync step of 5.69 s less its 62 % waiting for generation
  (3.53 s), which matches the 2.1-2.3 s per step the learner-bound runs (K >= 3) took;
- a rollout server advances every sequence it holds by one token per decode step, which takes
  2.56 ms + 0.0263 ms per sequence: 9.3 ms at 256 sequences (27.6k tokens/s, vLLM on an H200 with the
  sampled token's log-prob, docs/tuning.md), and the intercept such that the sync step's 128 samples of this
  length distribution (34.6k tokens, the longest 1,024) take its 3.53 s of generation;
- a weight-sync round after every step: the learner spends SYNC_S = 0.098 s (two H100s, docs/benchmarks.md),
  the server pauses PAUSE_S = 0.078 s (two H200s), its running sequences keep their place.
The buffer's rules are the product's own (`asyncrl.staleness`): admission capacity
(K + v + 1) * batch - (accepted + running), oldest groups first, and every group that starts is trained in full
(its weights are the learner's, so it starts within any K), however long it runs.

Drift model (an assumption, not a measurement): a batch's `rollout_corr/mismatch_kl` is 0.004 (`--kl-per-version`)
times its mean staleness, and its `is_clip_frac` 0.005 (`--clip-per-version`) times it, each with log-normal noise
(sigma 0.3, seeded). With the controller's default bounds (mismatch_kl 0.02, is_clip_frac 0.05) the drift bound
is reached at a mean staleness of 5 versions: K = 8, which trains samples about 5.6 versions old on this
workload, breaks it; K = 3-4 do not.

Prints one row per run (fixed K = 1, 2, 4, 8, then auto) and, last, `RESULT {json}`. The measured samples/s
beside each fixed K come from runs under the earlier rule, which stopped and dropped groups already staler than K.
Usage: `python scripts/pacing_sim.py [--steps 300] [--seed 0]`
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from dataclasses import dataclass, field

from asyncrl.config.buffer import PacingConfig
from learner.services.pacing import Pacer
from asyncrl.staleness import admission_capacity, staleness

TRAIN_S = 2.16  # learner seconds per step (5.69 s sync step x 38 % not waiting)
DECODE_FIXED_S, DECODE_PER_SEQUENCE_S = 2.56e-3, 2.63e-5  # one decode step of n sequences: fixed + n x per-sequence
SYNC_S = 0.098  # learner seconds per weight-sync round
PAUSE_S = 0.078  # server pause per round
BATCH_GROUPS, GROUP_SIZE, MAX_INFLIGHT = 16, 8, 256
MEDIAN_LEN, MAX_LEN = 192, 1024
DRIFT_NOISE = 0.3  # sigma of the log-normal noise on each batch's drift
FIXED_KS = (1, 2, 4, 8)
MEASURED_SAMPLES_PER_S = {1: "35.6", 2: "42.5-49.0", 4: "55.0-61.7", 8: "59.3"}  # the seventh GPU session (earlier rule)


@dataclass
class Group:
    version: int  # weights version the group started with: its oldest token version
    lengths: list[int]  # completion tokens of its samples
    unfinished: int  # samples still decoding


@dataclass
class RunResult:
    name: str
    samples_per_s: float
    tokens_per_s: float
    staleness_mean: float
    mismatch_kl: float  # mean over the timed steps
    kl_over_bound: float  # share of the timed steps whose batch drift was above the bound
    length_mean: float  # mean trained response length over the timed steps
    wait_share: float
    ks: list[int] = field(default_factory=list)  # K of each timed step
    changes: list[tuple[int, int]] = field(default_factory=list)  # (step, new K) of every change, warm-up included


class Simulation:
    """One server and one learner in simulated time. The engine advances all its sequences one token per decode
    step, whose duration grows with the number of sequences; events are sample ends, in decode steps."""

    def __init__(self, k: int, pacer: Pacer | None, seed: int, drift_per_version: tuple[float, float]) -> None:
        self.k, self.pacer = k, pacer
        self.kl_per_version, self.clip_per_version = drift_per_version
        self.rng = random.Random(seed)
        self.now = 0.0  # seconds
        self.decoded = 0.0  # decode steps the engine has made
        self.version = 0  # learner version; the server's weights follow it after each round
        self.accepted = 0  # groups stored for training, all time (admission's count)
        self.running: list[Group] = []  # groups being sampled (admission's running count)
        self.ends: list[tuple[float, int, Group]] = []  # per running sample: (decode step it ends at, tiebreak, group)
        self.finished: list[Group] = []  # durable in the buffer, not yet handed out
        self.p = 1 - 2 ** (-1 / MEDIAN_LEN)  # geometric lengths with the workload's median
        self._ids = 0

    def length(self) -> int:
        return min(MAX_LEN, 1 + int(math.log(1 - self.rng.random()) / math.log(1 - self.p)))

    def start_groups(self) -> None:
        """Admit and start as many groups as capacity and the engine's free sequence slots allow."""
        capacity = admission_capacity(self.version, self.k, BATCH_GROUPS, self.accepted, len(self.running))
        for _ in range(max(0, min(capacity, (MAX_INFLIGHT - len(self.ends)) // GROUP_SIZE))):
            group = Group(self.version, [], 0)
            self.running.append(group)
            self.sample(group)

    def sample(self, group: Group) -> None:
        group.lengths = [self.length() for _ in range(GROUP_SIZE)]
        group.unfinished = GROUP_SIZE
        for length in group.lengths:
            self._ids += 1
            heapq.heappush(self.ends, (self.decoded + length, self._ids, group))

    def advance(self, until: float) -> None:
        """Decode until `until`: samples end, groups finish and new ones start, in time order."""
        while True:
            self.start_groups()
            if not self.ends:
                self.now = until
                return
            step_s = decode_step_s(len(self.ends))
            ends_at = self.ends[0][0]
            if self.now + (ends_at - self.decoded) * step_s > until:
                self.decoded += (until - self.now) / step_s
                self.now = until
                return
            self.now += (ends_at - self.decoded) * step_s
            self.decoded = ends_at
            self.end_sample(heapq.heappop(self.ends))

    def end_sample(self, event: tuple[float, int, Group]) -> None:
        group = event[2]
        group.unfinished -= 1
        if group.unfinished == 0:
            self.running.remove(group)
            self.finished.append(group)
            self.accepted += 1

    def take_batch(self) -> tuple[list[Group], float]:
        """Wait until a batch of groups is there (oldest first); returns it and the wait."""
        started = self.now
        while True:
            if len(self.finished) >= BATCH_GROUPS:
                self.finished.sort(key=lambda group: group.version)
                batch, self.finished = self.finished[:BATCH_GROUPS], self.finished[BATCH_GROUPS:]
                return batch, self.now - started
            self.advance(self.now + (self.ends[0][0] - self.decoded) * decode_step_s(len(self.ends)) if self.ends else self.now)

    def sync(self) -> None:
        """A round: the server pauses (running sequences keep their place), then samples with the new version."""
        self.version += 1
        self.now += PAUSE_S
        self.advance(self.now + SYNC_S - PAUSE_S)

    def drift(self, mean_staleness: float) -> tuple[float, float]:
        noise = [math.exp(self.rng.gauss(0, DRIFT_NOISE)) for _ in range(2)]
        return self.kl_per_version * mean_staleness * noise[0], self.clip_per_version * mean_staleness * noise[1]

    def run(self, steps: int, warmup: int, name: str) -> RunResult:
        samples = tokens = 0
        waited = timed_s = stale_sum = kl_sum = 0.0
        over, ks, changes = 0, [], []
        bound = PacingConfig().max_mismatch_kl
        for step in range(steps):
            k_used = self.k
            began = self.now
            batch, wait_s = self.take_batch()
            lags = [staleness(self.version, group.version) for group in batch]
            mean_lag = sum(lags) / len(lags)
            kl, clip = self.drift(mean_lag)
            self.advance(self.now + TRAIN_S)
            self.sync()
            if self.pacer is not None:
                k_before = self.k
                self.k = self.pacer.observe(self.version, {
                    "timing_s/wait_batch": wait_s, "timing_s/step": wait_s + TRAIN_S, "rollout_corr/mismatch_kl": kl,
                    "rollout_corr/is_clip_frac": clip}).k
                if self.k != k_before:
                    changes.append((self.version, self.k))
            if step >= warmup:
                samples += BATCH_GROUPS * GROUP_SIZE
                tokens += sum(sum(group.lengths) for group in batch)
                waited, timed_s = waited + wait_s, timed_s + (self.now - began)
                stale_sum, kl_sum, over = stale_sum + mean_lag, kl_sum + kl, over + (kl > bound)
                ks.append(k_used)
        timed = steps - warmup
        return RunResult(name, samples / timed_s, tokens / timed_s, stale_sum / timed, kl_sum / timed, over / timed,
                         tokens / samples, waited / timed_s, ks, changes)


def decode_step_s(sequences: int) -> float:
    """Seconds of one decode step (one token for every running sequence)."""
    return DECODE_FIXED_S + DECODE_PER_SEQUENCE_S * sequences


def simulate(k: int | None, args: argparse.Namespace) -> RunResult:
    """A fixed-K run, or (k None) one paced by the controller with its default settings."""
    drift = (args.kl_per_version, args.clip_per_version)
    if k is not None:
        return Simulation(k, None, args.seed, drift).run(args.steps, args.warmup, f"K={k}")
    settings = PacingConfig()
    pacer = Pacer(settings, settings.k_start)
    return Simulation(pacer.k, pacer, args.seed, drift).run(args.steps, args.warmup, "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="learner steps per run")
    parser.add_argument("--warmup", type=int, default=30, help="leading steps left out of the figures")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and the drift noise")
    parser.add_argument("--kl-per-version", type=float, default=0.004, help="drift model: mismatch_kl per version of staleness")
    parser.add_argument("--clip-per-version", type=float, default=0.005, help="drift model: is_clip_frac per version of staleness")
    args = parser.parse_args()
    runs = [simulate(k, args) for k in FIXED_KS] + [simulate(None, args)]
    bound = PacingConfig().max_mismatch_kl
    within = [run for run in runs[:-1] if run.mismatch_kl <= bound]
    best = max(within, key=lambda run: run.samples_per_s)
    auto = runs[-1]
    print(f"{'run':<6} {'samples/s':>9} {'tokens/s':>9} {'vs best':>8} {'staleness':>9} {'mismatch_kl':>11} "
          f"{'steps>bound':>11} {'resp len':>9} {'waits':>6} {'K (timed steps)':>16} {'measured samples/s':>19}")
    for run in runs:
        k_range = f"{min(run.ks)}-{max(run.ks)}, mean {sum(run.ks) / len(run.ks):.1f}" if run is auto else str(run.ks[0])
        measured = MEASURED_SAMPLES_PER_S.get(run.ks[0], "-") if run is not auto else "-"
        print(f"{run.name:<6} {run.samples_per_s:>9.2f} {run.tokens_per_s:>9.0f} {run.samples_per_s / best.samples_per_s:>7.2f}x "
              f"{run.staleness_mean:>9.2f} {run.mismatch_kl:>11.4f} {run.kl_over_bound:>10.0%} "
              f"{run.length_mean:>9.1f} {run.wait_share:>6.0%} {k_range:>16} {measured:>19}")
    print(f"best fixed K within the drift bound (mean mismatch_kl <= {bound:g}): {best.name}; auto's K changes "
          f"(after step, new K): {auto.changes}")
    result = {
        "samples_per_s": {run.name: round(run.samples_per_s, 2) for run in runs},
        "mismatch_kl": {run.name: round(run.mismatch_kl, 4) for run in runs},
        "best_fixed": best.name, "auto_vs_best_fixed": round(auto.samples_per_s / best.samples_per_s, 3),
        "auto_k_mean": round(sum(auto.ks) / len(auto.ks), 2), "auto_k_max": max(auto.ks), "auto_k_changes": auto.changes,
        "auto_drift_within_bound": auto.mismatch_kl <= bound, "drift_bound": bound,
        "steps": args.steps, "warmup_steps": args.warmup, "seed": args.seed,
        "drift_per_version": {"mismatch_kl": args.kl_per_version, "is_clip_frac": args.clip_per_version},
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
