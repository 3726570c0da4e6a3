"""`asyncrl tune`: read a finished run's metrics and say which side held it back and what to try next.

The reading follows docs/tuning.md. Over the run's steps after the warm-up (the first tenth, at least one
step: engine warm-up and compilation), it compares three shares of the learner's wall time per step:
waiting for batches (generation-bound), weight-sync rounds (sync-bound) and training (learner-bound), and
derives K, the number of rollout servers and the micro-batch to try, each with the numbers behind it (and the
engine's CUDA graphs, where its servers kept more samples in flight than they cover). Then it reads the drift at that K
(`rollout_corr/mismatch_kl`, and the share of tokens a behaviour-anchored loss masked, `trust_region/masked_frac`)
against the run's drift bounds and says whether the loss holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from asyncrl.config import AsyncRLConfig
from asyncrl.learner_plan import LearnerPlan
from asyncrl.placement import listed_plan

WAIT_BOUND = 0.10  # the learner waiting more than this share of its time: generation-bound
SYNC_BOUND = 0.25  # weight sync taking more than this share (and more than the waiting): sync-bound
SYNC_TARGET = 0.10  # share of the time weight sync should take after the advice
WARMUP_SHARE = 0.10  # leading share of the steps left out (engine warm-up, compilation)
BUSY_IDLE = 0.05  # servers idle less than this share of their uptime always had work
FULL_SLOTS = 0.9  # servers running at least this share of their slots (rollout.max_inflight) on average were full
DRIFT_KEYS = ("rollout_corr/mismatch_kl", "rollout_corr/is_clip_frac")
MASKED_KEY = "trust_region/masked_frac"  # logged by the behaviour-anchored losses (dppo_tv, dppo_kl, m2po)
SERVERS_KEY = "rollout/servers"  # rollout servers alive at a step (their telemetry heard within the liveness bound)
BEHAVIOUR_ANCHORED = ("dppo_tv", "dppo_kl", "m2po", "decoupled_ppo_kl", "naive_ppo")  # losses bounding π_θ against π_behav
PROXIMAL_CLIPPED = ("decoupled_ppo", "seq_mask")  # losses whose clip anchors on π_prox: it binds only from a batch's second step
BOUND_KEYS = {"dppo_tv": "algorithm.dppo_tv_bound", "dppo_kl": "algorithm.dppo_kl_bound", "m2po": "algorithm.m2_threshold"}
VLLM_GRAPHED_MAX = 512  # vLLM's largest CUDA-graphed engine step where none is set: min(2 x max_num_seqs, 512) sequences
# the engine kept full at 1,536 in flight with graphs up to there, against vLLM's 512: one H100, ~600 M parameters
# (docs/benchmarks.md)
GRAPHED_CEILING_GAIN = 1.20


class NotEnoughSteps(ValueError):
    """The run logged too few learner steps to read."""


@dataclass(frozen=True)
class RunSettings:
    """What the run was configured with (from its config.yaml)."""

    k: str  # buffer.max_staleness: a number or auto
    k_max: int  # buffer.pacing.k_max (auto's ceiling)
    max_mismatch_kl: float  # buffer.pacing.max_mismatch_kl (auto's drift bound)
    max_is_clip_frac: float  # buffer.pacing.max_is_clip_frac (auto's bound on the share of tokens corrected or masked)
    num_servers: int  # rollout.num_servers
    slots: int  # samples the servers may run at once: rollout.max_inflight x rollout.num_servers
    micro_batch_tokens: str  # learner.micro_batch_tokens: a number or auto
    sync_every: int  # learner.sync_every
    loss: str  # algorithm.loss
    optimizer_steps: int  # optimizer steps per batch: algorithm.mini_batches × algorithm.epochs
    shared_gpu: bool  # every server ran on the learner's GPU (a one-GPU job): the two sides shared its time
    checkpointing: str  # learner.activation_checkpointing as configured
    compiled: bool  # learner.compile
    checkpointing_ran: str | None = None  # the mode the learner ran in (auto resolved), where the run recorded its plan
    max_inflight: int = 0  # rollout.max_inflight: samples one server may run at once
    # the largest engine step (sequences) vLLM replays as a CUDA graph; None: no graphs (an eager engine, or servers
    # not on GPUs)
    graphed_sequences: int | None = None

    @classmethod
    def of(cls, config: AsyncRLConfig, passes: LearnerPlan | None = None) -> RunSettings:
        """The run's settings from its config, and from `passes` (the learner's recorded plan) what it resolved."""
        pacing, algorithm, learner = config.buffer.pacing, config.algorithm, config.learner
        plan = listed_plan(config)
        shared = bool(plan.learner and plan.servers) and plan.sharing == len(plan.servers)
        engine, max_inflight = config.rollout.engine, config.rollout.max_inflight
        graphed = (None if engine.enforce_eager or not plan.servers else
                   engine.cudagraph_max_sequences or min(2 * max_inflight, VLLM_GRAPHED_MAX))
        return cls(config.buffer.max_staleness, pacing.k_max, pacing.max_mismatch_kl, pacing.max_is_clip_frac,
                   config.rollout.num_servers, config.rollout.max_inflight * config.rollout.num_servers,
                   learner.micro_batch_tokens, learner.sync_every,
                   algorithm.loss, algorithm.mini_batches * algorithm.epochs, shared, learner.activation_checkpointing,
                   learner.compile, passes.activation_checkpointing if passes else None, max_inflight, graphed)


@dataclass(frozen=True)
class RunReading:
    """Means over the read steps."""

    steps: int  # steps read (after the warm-up)
    step_s: float  # wall seconds per step: training, waiting and weight sync
    wait_share: float  # timing_s/wait_batch / step_s
    sync_share: float  # weight_sync/seconds / step_s
    k_mean: float | None  # staleness/max_staleness (the bound in effect); None: the run did not log it
    k_last: int | None  # the bound at the last step
    staleness_mean: float  # staleness/mean
    mismatch_kl: float  # rollout_corr/mismatch_kl
    is_clip_frac: float  # rollout_corr/is_clip_frac
    masked_frac: float | None  # trust_region/masked_frac; None: the loss logged none
    rollout_idle: float  # rollout/idle_ratio at the last step that logged it (a whole-run figure)
    inflight: float | None  # rollout/inflight (samples running on all servers) over the read steps; None: not logged
    servers_fewest: int | None  # rollout/servers: the fewest alive at a read step; None: not logged
    completion_tokens: float  # completion tokens trained per step: response_length/mean x batch/samples

    @property
    def train_share(self) -> float:
        return 1 - self.wait_share - self.sync_share

    @property
    def verdict(self) -> str:
        if self.sync_share > SYNC_BOUND and self.sync_share >= self.wait_share:
            return "sync-bound"
        return "generation-bound" if self.wait_share > WAIT_BOUND else "learner-bound"


def read_steps(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The learner-step records read: every one after the warm-up (NotEnoughSteps with fewer than 2 steps)."""
    steps = [record for record in records if record.get("timing_s/step") is not None]
    if len(steps) < 2:
        raise NotEnoughSteps(f"the run logged {len(steps)} learner step(s); `asyncrl tune` needs at least 2")
    return steps[max(1, int(len(steps) * WARMUP_SHARE)):]


def read_run(records: Sequence[Mapping[str, Any]]) -> RunReading:
    """The reading of a run's metrics records (one per learner step)."""
    read = read_steps(records)
    sync_s = sum(record.get("weight_sync/seconds") or 0.0 for record in read) / len(read)  # rounds every sync_every steps
    step_s = mean_of(read, "timing_s/step") + sync_s  # a step's round comes after its timing_s/step
    idle = [record["rollout/idle_ratio"] for record in records if record.get("rollout/idle_ratio") is not None]
    ks = [record["staleness/max_staleness"] for record in read if record.get("staleness/max_staleness") is not None]
    return RunReading(
        steps=len(read), step_s=step_s, wait_share=mean_of(read, "timing_s/wait_batch") / step_s,
        sync_share=sync_s / step_s, k_mean=sum(ks) / len(ks) if ks else None, k_last=int(ks[-1]) if ks else None,
        staleness_mean=mean_of(read, "staleness/mean"),
        mismatch_kl=mean_of(read, DRIFT_KEYS[0]), is_clip_frac=mean_of(read, DRIFT_KEYS[1]),
        masked_frac=logged_mean(read, MASKED_KEY),
        rollout_idle=idle[-1] if idle else 0.0,
        inflight=logged_mean(read, "rollout/inflight"),
        servers_fewest=fewest_servers(read),
        completion_tokens=sum(r.get("response_length/mean", 0.0) * r.get("batch/samples", 0.0) for r in read) / len(read),
    )


def advise(reading: RunReading, settings: RunSettings) -> list[str]:
    """The verdict with its numbers, then one piece of advice each for K, servers, micro-batch and drift, and for the
    engine's CUDA graphs where its steps outgrew them."""
    lines = [_verdict_line(reading, settings), _k_advice(reading, settings), _servers_advice(reading, settings),
             _micro_batch_advice(reading, settings), _drift_advice(reading, settings)]
    graphs = _graphs_advice(reading, settings)
    missing = _missing_servers_note(reading, settings)
    return ([missing] if missing else []) + lines + ([graphs] if graphs else [])


def _missing_servers_note(r: RunReading, s: RunSettings) -> str | None:
    """Where fewer servers than the run was given were alive at a read step: the rest of the advice reads what those
    fewer did, so this comes first. None where all were (or the run logged no count)."""
    if r.servers_fewest is None or r.servers_fewest >= s.num_servers:
        return None
    return (f"first: only {r.servers_fewest} of rollout.num_servers={s.num_servers} servers were alive at some read "
            "step (rollout/servers): one failed to start, died or went silent, and its log under logs/ says which; "
            "the advice below reads what the fewer servers did")


def _verdict_line(r: RunReading, s: RunSettings) -> str:
    bound = f"K {r.k_mean:.2f} (last {r.k_last})" if r.k_mean is not None else f"K {s.k}"
    return (f"{r.verdict} over {r.steps} steps of {r.step_s:.3f} s: the learner waited for batches "
            f"{r.wait_share:.0%} of the time, weight sync took {r.sync_share:.0%}, training the rest "
            f"({r.train_share:.0%}); rollout servers idle {r.rollout_idle:.0%}; staleness "
            f"trained {r.staleness_mean:.2f} under {bound}; mismatch_kl {r.mismatch_kl:.4f}, is_clip_frac "
            f"{r.is_clip_frac:.3f}")


def _k_advice(r: RunReading, s: RunSettings) -> str:
    paced = s.k == "auto"
    if r.verdict == "sync-bound":
        every = math.ceil(s.sync_every * r.sync_share / SYNC_TARGET)
        return (f"sync: learner.sync_every={every} (weight sync {r.sync_share:.0%} of each step at sync_every="
                f"{s.sync_every}; {SYNC_TARGET:.0%} at {every}) with K ≥ {every}: samples get up to {every - 1} "
                "versions staler")
    if r.verdict == "generation-bound":
        held_back = _slots_held_back(r, s)
        if s.shared_gpu and r.rollout_idle < BUSY_IDLE and not held_back:
            k = f"K={r.k_last} (auto)" if paced and r.k_last is not None else f"K={s.k}"
            running = f", {r.inflight:.0f} of their {s.slots} slots running" if r.inflight is not None else ""
            return (f"K: keep {k}: the servers on the learner's GPU were never short of work (idle "
                    f"{r.rollout_idle:.0%}{running}), so more samples in flight add no generation on that GPU")
        if paced and r.k_last is not None and r.k_last >= s.k_max:
            return (f"K: the controller reached buffer.pacing.k_max={s.k_max} while the learner still waited "
                    f"{r.wait_share:.0%}: raise k_max if the drift allows (mismatch_kl {r.mismatch_kl:.4f}, bound "
                    f"{s.max_mismatch_kl:g}), or add generation (servers, below)")
        if paced:
            return (f"K: the drift held the controller at K={r.k_last} (mismatch_kl {r.mismatch_kl:.4f}, bound "
                    f"{s.max_mismatch_kl:g}) while the learner still waited {r.wait_share:.0%}: add generation "
                    "(servers, below) rather than staleness")
        note = _held_back_note(r, s) if held_back else ""
        return (f"K: buffer.max_staleness={int(s.k) + 1} or auto (the learner waited {r.wait_share:.0%} "
                f"of the time at K={s.k}: generation may run one version further ahead{note})")
    if paced:
        return (f"K: the controller settled at K={r.k_last} (mean {r.k_mean:.2f}) with the learner waiting "
                f"{r.wait_share:.0%}: buffer.max_staleness={r.k_last} gives the same pace as a fixed bound")
    fixed = int(s.k)
    if fixed <= 1:
        return f"K: keep buffer.max_staleness={fixed} (the learner waited only {r.wait_share:.0%}: the smallest useful K)"
    return (f"K: buffer.max_staleness={fixed - 1} or auto (the learner waited only {r.wait_share:.0%} at K={fixed}, "
            f"trained samples {r.staleness_mean:.2f} versions old: a smaller K trains fresher samples at the same speed)")


def _slots_held_back(r: RunReading, s: RunSettings) -> bool:
    """Whether the servers' engines held fewer requests than their slots allow: an idle share near 0 says a request
    was always running, not that every slot was; a larger K lets admission start more samples, and a decode step over
    more of them makes more tokens."""
    return r.inflight is not None and r.inflight < FULL_SLOTS * s.slots


def _held_back_note(r: RunReading, s: RunSettings) -> str:
    return (f"; the servers' engines held {r.inflight:.0f} requests on average of the {s.slots} slots "
            "rollout.max_inflight gives them: a larger K starts more samples, a fuller engine makes more tokens a step")


def _servers_advice(r: RunReading, s: RunSettings) -> str:
    if r.verdict == "generation-bound" and s.shared_gpu:
        return (f"servers: more servers on the learner's GPU share the same GPU's time (each step "
                f"{r.step_s * r.wait_share:.3f} s waiting for generation, {r.step_s * r.train_share:.3f} s training "
                "beside it): they add generation only where one engine's steps, each one CPU core's work, leave the "
                "GPU idle (measure: scripts/bench_engines.py --engines 1,2, docs/tuning.md); "
                "else give generation GPUs of its own (more GPUs, rollout.placement=auto), or make training cheaper "
                "(learner, below)")
    if r.verdict == "generation-bound":
        wanted = math.ceil(s.num_servers / (1 - r.wait_share))
        return (f"servers: rollout.num_servers={wanted} (generation delivered a batch every {r.step_s:.3f} s, "
                f"training took {r.step_s * (1 - r.wait_share):.3f} s of it: {1 / (1 - r.wait_share):.2f}x the "
                f"generation rate keeps the learner busy), or a larger rollout.max_inflight while the KV cache has room")
    needed = max(1, math.ceil(s.num_servers * (1 - r.rollout_idle)))
    if needed < s.num_servers:
        return (f"servers: {needed} of the {s.num_servers} would do (they were idle {r.rollout_idle:.0%} of their "
                f"uptime): give the rest to the learner (learner.nproc) if they are GPUs")
    return f"servers: keep rollout.num_servers={s.num_servers} (idle {r.rollout_idle:.0%} of their uptime)"


def _micro_batch_advice(r: RunReading, s: RunSettings) -> str:
    if r.verdict == "generation-bound" and s.shared_gpu:
        return (f"learner: training took {r.train_share:.0%} of each step on the GPU generation shares with it: the GPU "
                f"time it saves goes to generation: {_cheaper_training(s)}")
    if r.verdict != "learner-bound":
        return f"micro-batch: keep learner.micro_batch_tokens={s.micro_batch_tokens} (the learner is not what limits the run)"
    if s.micro_batch_tokens == "auto":
        return ("micro-batch: already auto (the largest that fits): speed the learner with learner.compile=true, "
                "packing (learner.packing=always) or more ranks (learner.nproc)")
    tokens = int(s.micro_batch_tokens)
    if tokens >= r.completion_tokens:
        return (f"micro-batch: {tokens} tokens already hold a whole step's {r.completion_tokens:.0f} completion tokens: "
                "speed the learner with learner.compile=true or more ranks (learner.nproc)")
    return (f"micro-batch: learner.micro_batch_tokens=auto or {2 * tokens} (a step trains {r.completion_tokens:.0f} "
            f"completion tokens in about {math.ceil(r.completion_tokens / tokens)} micro-batches of {tokens}: fewer, "
            "larger ones use the device better while memory allows)")


def _cheaper_training(s: RunSettings) -> str:
    """What makes a learner step take less GPU time, from the run's own settings."""
    ways = [] if s.compiled else ["learner.compile=true"]
    ran = s.checkpointing_ran or s.checkpointing
    if ran != "none":
        named = f"{s.checkpointing}, which chose {ran}" if ran != s.checkpointing else ran
        ways.append(f"learner.activation_checkpointing=none (the run's: {named}; auto picks none only where "
                    "its passes fit: a lower rollout.engine.gpu_memory_utilization leaves the learner more)")
    return ", ".join(ways) if ways else "more learner ranks on GPUs of their own (learner.nproc)"


def _drift_advice(r: RunReading, s: RunSettings) -> str:
    """Whether the drift at the run's K stayed inside its bounds, and what to change when it did not."""
    k = r.k_last if r.k_last is not None else s.k
    lower = _lower_k(s)
    if r.masked_frac is not None and r.masked_frac > s.max_is_clip_frac:
        bound = BOUND_KEYS.get(s.loss, "its bound")
        return (f"drift: {s.loss} masked {r.masked_frac:.1%} of the trained tokens at K={k} ({MASKED_KEY}, above "
                f"buffer.pacing.max_is_clip_frac={s.max_is_clip_frac:g}; mismatch_kl {r.mismatch_kl:.4f}): those tokens "
                f"train nothing; {lower}, or loosen {bound} if the held-out reward holds")
    if r.mismatch_kl <= s.max_mismatch_kl:
        masked = f", {r.masked_frac:.1%} of tokens masked" if r.masked_frac is not None else ""
        return (f"drift: mismatch_kl {r.mismatch_kl:.4f} at K={k} is within buffer.pacing.max_mismatch_kl="
                f"{s.max_mismatch_kl:g}{masked}: {s.loss} holds this K")
    high = f"drift: mismatch_kl {r.mismatch_kl:.4f} at K={k} is above buffer.pacing.max_mismatch_kl={s.max_mismatch_kl:g}"
    if s.loss in BEHAVIOUR_ANCHORED:
        return (f"{high}; {s.loss} bounds the policy against the one that sampled: watch the held-out reward, and "
                f"{lower} if it falls")
    steps = (", or several optimizer steps per batch (algorithm.mini_batches) so its clip around π_prox binds"
             if s.loss in PROXIMAL_CLIPPED and s.optimizer_steps == 1 else "")
    return (f"{high}, and {s.loss} has no trust region anchored to the policy that sampled: {lower}, or switch to a "
            f"behaviour-anchored loss (algorithm.loss=dppo_tv, m2po or decoupled_ppo_kl; docs/losses.md){steps}")


def _graphs_advice(r: RunReading, s: RunSettings) -> str | None:
    """Where generation held the run back while its servers kept more samples in flight than their engines' CUDA
    graphs cover (the larger engine steps run without one): graphs up to every slot. None elsewhere."""
    if r.verdict != "generation-bound" or s.graphed_sequences is None or r.inflight is None:
        return None
    in_flight = r.inflight / s.num_servers  # per server
    if in_flight <= s.graphed_sequences:
        return None
    return (f"engine: each server kept {in_flight:.0f} samples in flight on average, above the {s.graphed_sequences} "
            "sequences a step its CUDA graphs cover, so its larger steps ran without one: "
            f"rollout.engine.cudagraph_max_sequences={s.max_inflight} (graphs up to every slot; the engine kept full "
            f"made {GRAPHED_CEILING_GAIN:.2f}x the tokens/s so on one H100, docs/tuning.md)")


def _lower_k(s: RunSettings) -> str:
    if s.k == "auto":
        return f"lower K (buffer.pacing.k_max below {s.k_max}, or a smaller buffer.pacing.max_mismatch_kl)"
    fixed = int(s.k)
    return f"lower K (buffer.max_staleness={fixed - 1})" if fixed > 0 else "K is 0 already: the drift is the engine's own"


def fewest_servers(records: Sequence[Mapping[str, Any]]) -> int | None:
    """The fewest rollout servers alive at any of `records` (None where none logged the count): below the servers a
    run was given, one failed to start, died or went silent, and what the run did is not that many servers' doing."""
    return min((int(record[SERVERS_KEY]) for record in records if record.get(SERVERS_KEY) is not None), default=None)


def mean_of(records: Sequence[Mapping[str, Any]], key: str) -> float:
    """The mean of `key` over the records that logged it (0 where none did)."""
    return logged_mean(records, key) or 0.0


def logged_mean(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The mean of `key` over the records that logged it (None where none did)."""
    values = [record[key] for record in records if record.get(key) is not None]
    return sum(values) / len(values) if values else None
