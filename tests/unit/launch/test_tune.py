"""`asyncrl tune RUN_DIR` on hand-built runs: one per verdict, each with the numbers its advice must name."""

import pytest

from launch.cli import main
from asyncrl.config import load_config, save_config
from asyncrl.config.sections import MetricsConfig
from asyncrl.metrics import MetricsLogger
from asyncrl.learner_plan import LearnerPlan, write_plan
from launch.tuning import NotEnoughSteps, read_run

STEPS = 20  # the first 2 (a tenth) are left out as warm-up


def write_run(run_dir, overrides: list[str], step: dict[str, float], warmup: dict[str, float] | None = None) -> None:
    save_config(load_config(None, overrides), run_dir)
    logger = MetricsLogger(run_dir, MetricsConfig(wandb_mode="disabled"))
    for number in range(1, STEPS + 1):
        logger.log(number, (warmup or step) if number <= 2 and warmup else step)
    logger.close()


def steady(wait_s: float, train_s: float, sync_s: float = 0.0, **extra: float) -> dict[str, float]:
    return {"timing_s/wait_batch": wait_s, "timing_s/step": wait_s + train_s, "weight_sync/seconds": sync_s,
            "staleness/mean": 1.5, "staleness/max_staleness": 2.0, "rollout_corr/mismatch_kl": 0.004,
            "rollout_corr/is_clip_frac": 0.01, "response_length/mean": 100.0, "batch/samples": 64.0,
            "rollout/idle_ratio": 0.0} | extra


def tune(run_dir, capsys) -> list[str]:
    assert main(["tune", str(run_dir)]) == 0
    return capsys.readouterr().out.strip().splitlines()


def test_generation_bound(tmp_path, capsys):
    # waits 0.6 of a 1.6 s step (sync 0.4 s after it): 30 % of 2.0 s; warm-up steps that waited 50 s are left out
    write_run(tmp_path, ["buffer.max_staleness=2", "rollout.num_servers=2"], steady(0.6, 1.0, 0.4),
              warmup=steady(50.0, 1.0, 0.4))
    verdict, k, servers, micro, _, *split = tune(tmp_path, capsys)
    assert verdict.startswith("generation-bound over 18 steps of 2.000 s: the learner waited for batches 30%")
    assert "weight sync took 20%" in verdict and "training the rest (50%)" in verdict
    assert k.startswith("K: buffer.max_staleness=3 or auto")
    # 2 servers / (1 - 0.3) = 2.86 -> 3; 1 / 0.7 = 1.43x the generation rate
    assert servers.startswith("servers: rollout.num_servers=3") and "1.43x" in servers
    assert micro.startswith("micro-batch: keep")
    assert split == ["split: the learner ran on the CPU: no GPU split applies"]


def test_a_run_that_had_fewer_servers_alive_than_it_was_given_is_told_so_first(tmp_path, capsys):
    # two servers on the learner's GPU, one of which died after the warm-up steps (which the reading leaves out)
    write_run(tmp_path, ["buffer.max_staleness=4", "rollout.num_servers=2"],
              steady(4.5, 2.0, **{"rollout/servers": 1.0}), warmup=steady(0.01, 2.0, **{"rollout/servers": 2.0}))
    missing, verdict, *_ = tune(tmp_path, capsys)
    assert missing.startswith("first: only 1 of rollout.num_servers=2 servers were alive at some read step")
    assert verdict.startswith("generation-bound over 18 steps")
    write_run(tmp_path / "all", ["rollout.num_servers=2"], steady(4.5, 2.0, **{"rollout/servers": 2.0}))
    assert not tune(tmp_path / "all", capsys)[0].startswith("first:")  # both alive: no note


def test_learner_bound_with_a_small_micro_batch(tmp_path, capsys):
    write_run(tmp_path, ["buffer.max_staleness=4", "rollout.num_servers=4", "learner.micro_batch_tokens=1024"],
              steady(0.01, 0.99, **{"rollout/idle_ratio": 0.5}))
    verdict, k, servers, micro, *_ = tune(tmp_path, capsys)
    assert verdict.startswith("learner-bound over 18 steps of 1.000 s: the learner waited for batches 1%")
    assert k.startswith("K: buffer.max_staleness=3 or auto") and "1.50 versions old" in k
    assert servers.startswith("servers: 2 of the 4 would do") and "idle 50%" in servers
    # 100 tokens x 64 samples = 6,400 per step: 7 micro-batches of 1,024
    assert micro.startswith("micro-batch: learner.micro_batch_tokens=auto or 2048") and "about 7 micro-batches" in micro


def test_sync_bound(tmp_path, capsys):
    # sync 0.5 s after a 0.5 s step: 50 % of the time; at sync_every=1 -> ceil(1 · 0.5 / 0.1) = 5
    write_run(tmp_path, ["buffer.max_staleness=1"], steady(0.05, 0.45, 0.5))
    verdict, k, *_ = tune(tmp_path, capsys)
    assert verdict.startswith("sync-bound") and "weight sync took 50%" in verdict
    assert k.startswith("sync: learner.sync_every=5") and "K ≥ 5" in k


def test_a_paced_run_reports_where_the_controller_settled(tmp_path, capsys):
    write_run(tmp_path, ["buffer.max_staleness=auto"], steady(0.02, 0.98, **{"staleness/max_staleness": 3.0}))
    _, k, *_ = tune(tmp_path, capsys)
    assert k.startswith("K: the controller settled at K=3 (mean 3.00)")


@pytest.mark.parametrize("last_k, expected", [
    (8.0, "K: the controller reached buffer.pacing.k_max=8 while the learner still waited 30%"),
    (3.0, "K: the drift held the controller at K=3 (mismatch_kl 0.0300, bound 0.02)"),
])
def test_a_paced_generation_bound_run_says_what_stopped_k(tmp_path, capsys, last_k, expected):
    write_run(tmp_path, ["buffer.max_staleness=auto"],
              steady(0.3, 0.7, **{"staleness/max_staleness": last_k, "rollout_corr/mismatch_kl": 0.03}))
    _, k, *_ = tune(tmp_path, capsys)
    assert k.startswith(expected)


def test_a_run_from_before_k_was_logged_names_the_configured_k(tmp_path, capsys):
    step = steady(0.0, 1.0)
    del step["staleness/max_staleness"]
    write_run(tmp_path, ["buffer.max_staleness=2"], step)
    assert "staleness trained 1.50 under K 2;" in tune(tmp_path, capsys)[0]


def test_a_gpu_run_gets_the_split_of_its_gpus_or_of_another_hosts(tmp_path, capsys):
    # a server 1,000 tokens/s, never idle; a rank 8,000 / 2 = 4,000 (launch/gpu_split.py; tests/unit/launch/test_gpu_split.py)
    rates = {"rollout/server-0/tokens_per_s": 1000.0, "rollout/server-0/idle_ratio": 0.0, "memory/peak_gib": 40.0,
             "rollout/server-1/tokens_per_s": 1000.0, "rollout/server-1/idle_ratio": 0.0,
             "learner/tokens_per_s": 8000.0, "timing_s/train": 0.7}
    write_run(tmp_path, ["rollout.num_servers=2", "rollout.gpus=[0,1]", "learner.nproc=2", "learner.gpus=[2,3]"],
              steady(0.3, 0.7, **rates))
    assert tune(tmp_path, capsys)[5].startswith("split: 3 servers + 1 learner rank (rollout.num_servers=3 "
                                                "learner.nproc=1) on the 4 GPUs instead of the run's 2 + 2")
    assert main(["tune", str(tmp_path), "--gpus", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[5].startswith("split: on 8 GPUs, 6 servers + 2 learner ranks")
    assert main(["tune", str(tmp_path), "--gpus", "eight"]) == 1
    assert "--gpus eight: give the host's number of GPUs, a whole number above 0" in capsys.readouterr().err


def test_a_run_without_metrics_or_steps_fails_clearly(tmp_path, capsys):
    assert main(["tune", str(tmp_path)]) == 1
    assert "no config.yaml" in capsys.readouterr().err
    save_config(load_config(None, []), tmp_path)
    assert main(["tune", str(tmp_path)]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(NotEnoughSteps, match="1 learner step"):
        read_run([steady(0.1, 0.9)])


# ------------------------------------------------------------------------------------ drift at the chosen K


@pytest.mark.parametrize("overrides, extra, expected", [
    (["buffer.max_staleness=2"], {},  # mismatch_kl 0.004, default bound 0.02, the default loss
     "drift: mismatch_kl 0.0040 at K=2 is within buffer.pacing.max_mismatch_kl=0.02: decoupled_ppo_kl holds this K"),
    # m2po masked 12 % of the tokens at K = 4 (above buffer.pacing.max_is_clip_frac = 0.05)
    (["buffer.max_staleness=4", "algorithm.loss=m2po"],
     {"trust_region/masked_frac": 0.12, "rollout_corr/mismatch_kl": 0.09, "staleness/max_staleness": 4.0},
     "drift: m2po masked 12.0% of the trained tokens at K=4 (trust_region/masked_frac, above "
     "buffer.pacing.max_is_clip_frac=0.05; mismatch_kl 0.0900): those tokens train nothing; lower K "
     "(buffer.max_staleness=3), or loosen algorithm.m2_threshold if the held-out reward holds"),
    # a behaviour-anchored loss with few masked tokens, above the drift bound
    (["buffer.max_staleness=auto", "algorithm.loss=dppo_tv", "algorithm.mini_batches=4"],
     {"trust_region/masked_frac": 0.01, "rollout_corr/mismatch_kl": 0.05, "staleness/max_staleness": 3.0},
     "drift: mismatch_kl 0.0500 at K=3 is above buffer.pacing.max_mismatch_kl=0.02; dppo_tv bounds the policy "
     "against the one that sampled: watch the held-out reward, and lower K (buffer.pacing.k_max below 8, or a "
     "smaller buffer.pacing.max_mismatch_kl) if it falls"),
], ids=["within-bound", "masked-share", "behaviour-anchored"])
def test_the_drift_line_reads_the_drift_against_the_runs_bounds(tmp_path, capsys, overrides, extra, expected):
    write_run(tmp_path, overrides, steady(0.0, 1.0, **extra))
    assert tune(tmp_path, capsys)[4] == expected


def test_high_drift_under_a_proximal_loss_suggests_a_smaller_k_or_a_behaviour_anchored_loss(tmp_path, capsys):
    write_run(tmp_path, ["buffer.max_staleness=8", "algorithm.loss=decoupled_ppo"],
              steady(0.0, 1.0, **{"rollout_corr/mismatch_kl": 0.35, "staleness/max_staleness": 8.0}))
    drift = tune(tmp_path, capsys)[4]
    assert drift.startswith("drift: mismatch_kl 0.3500 at K=8 is above buffer.pacing.max_mismatch_kl=0.02, and "
                            "decoupled_ppo has no trust region anchored to the policy that sampled: lower K "
                            "(buffer.max_staleness=7), or switch to a behaviour-anchored loss (algorithm.loss=dppo_tv")
    assert drift.endswith("so its clip around π_prox binds")  # one optimizer step per batch


def test_a_one_gpu_run_waiting_on_generation_is_told_the_gpu_is_the_limit_not_k_or_servers(tmp_path, capsys):
    # learner and its one server on GPU 0, the server never idle: generation and training share that GPU's time
    write_run(tmp_path, ["buffer.max_staleness=2", "rollout.gpus=[0]", "learner.gpus=[0]",
                         "learner.activation_checkpointing=selective"], steady(4.6, 3.6, 0.2))
    verdict, k, servers, learner, _, split = tune(tmp_path, capsys)
    assert verdict.startswith("generation-bound over 18 steps of 8.400 s: the learner waited for batches 55%")
    assert k == ("K: keep K=2: the servers on the learner's GPU were never short of work (idle 0%), so more samples in "
                 "flight add no generation on that GPU")
    assert servers.startswith("servers: more servers on the learner's GPU share the same GPU's time (each step "
                              "4.600 s waiting for generation, 3.600 s training beside it): they add generation only "
                              "where one engine's steps, each one CPU core's work, leave the GPU idle (measure: "
                              "scripts/bench_engines.py --engines 1,2")
    assert learner.startswith("learner: training took 43% of each step on the GPU generation shares with it")
    assert "learner.compile=true, learner.activation_checkpointing=none (the run's: selective;" in learner
    assert split.startswith("split: the learner shared its GPU with every server")
    # a server that sat idle for want of work: more in flight does help, as on GPUs apart
    starved = tmp_path / "starved"
    write_run(starved, ["buffer.max_staleness=2", "rollout.gpus=[0]", "learner.gpus=[0]"],
              steady(4.6, 3.6, 0.2, **{"rollout/idle_ratio": 0.3}))
    assert tune(starved, capsys)[1].startswith("K: buffer.max_staleness=3 or auto")


@pytest.mark.parametrize("inflight, expected", [
    # 30 of 32 slots running: the engine was full, a larger K starts nothing more
    (30.0, "K: keep K=2: the servers on the learner's GPU were never short of work (idle 0%, 30 of their 32 slots "
           "running), so more samples in flight add no generation on that GPU"),
    # never idle, yet half the slots empty: a larger K lets admission start more samples
    (16.0, "K: buffer.max_staleness=3 or auto (the learner waited 55% of the time at K=2: generation may run one "
           "version further ahead; the servers' engines held 16 requests on average of the 32 slots "
           "rollout.max_inflight gives them: a larger K starts more samples, a fuller engine makes more tokens a step)"),
])
def test_a_one_gpu_run_never_idle_is_told_to_raise_k_only_while_slots_sat_empty(tmp_path, capsys, inflight, expected):
    write_run(tmp_path, ["buffer.max_staleness=2", "rollout.gpus=[0]", "learner.gpus=[0]", "rollout.max_inflight=32"],
              steady(4.6, 3.6, 0.2, **{"rollout/inflight": inflight}))
    assert tune(tmp_path, capsys)[1] == expected


@pytest.mark.parametrize("ran, advice", [
    ("none", "learner: training took 43% of each step on the GPU generation shares with it: the GPU time it saves goes "
             "to generation: learner.compile=true"),  # auto ran without checkpointing: nothing to turn off
    ("full", "learner.compile=true, learner.activation_checkpointing=none (the run's: auto, which chose full;"),
    (None, "learner.compile=true, learner.activation_checkpointing=none (the run's: auto;"),  # no plan recorded
])
def test_the_learner_advice_reads_the_checkpointing_the_run_ran_with(tmp_path, capsys, ran, advice):
    write_run(tmp_path, ["buffer.max_staleness=2", "rollout.gpus=[0]", "learner.gpus=[0]"], steady(4.6, 3.6, 0.2))
    if ran is not None:
        write_plan(tmp_path, LearnerPlan(micro_batch_tokens=20480, packed=True, activation_checkpointing=ran))
    learner = tune(tmp_path, capsys)[3]
    assert learner == advice if ran == "none" else learner.startswith("learner: ") and advice in learner


GRAPHS_RUN = ["buffer.max_staleness=4", "rollout.gpus=[0]", "learner.gpus=[0]", "rollout.max_inflight=1536",
              "rollout.engine.enforce_eager=false"]


def test_a_run_whose_engine_steps_outgrew_its_cuda_graphs_is_told_to_capture_up_to_its_slots(tmp_path, capsys):
    # 1,530 samples running against vLLM's own graphs up to 512 sequences a step: most steps ran without a graph
    write_run(tmp_path, GRAPHS_RUN, steady(4.0, 2.1, 0.3, **{"rollout/inflight": 1530.0}))
    lines = tune(tmp_path, capsys)
    assert lines[0].startswith("generation-bound")
    assert lines[5] == ("engine: each server kept 1530 samples in flight on average, above the 512 sequences a step "
                        "its CUDA graphs cover, so its larger steps ran without one: "
                        "rollout.engine.cudagraph_max_sequences=1536 (graphs up to every slot; the engine kept full "
                        "made 1.20x the tokens/s so on one H100, docs/tuning.md)")


@pytest.mark.parametrize("overrides, inflight, wait_s", [
    (["rollout.engine.cudagraph_max_sequences=1536"], 1530.0, 4.0),  # graphs up to every slot already
    (["rollout.engine.enforce_eager=true"], 1530.0, 4.0),  # an eager engine captures no graphs
    ([], 400.0, 4.0),  # its steps fit vLLM's own 512
    ([], 1530.0, 0.1),  # learner-bound: generation is not what holds it back
    (["rollout.gpus=[]", "learner.gpus=[]"], 1530.0, 4.0),  # servers not on GPUs (a CPU run's config)
])
def test_the_engine_line_appears_only_where_graphs_would_help(tmp_path, capsys, overrides, inflight, wait_s):
    write_run(tmp_path, GRAPHS_RUN + overrides, steady(wait_s, 2.1, 0.3, **{"rollout/inflight": inflight}))
    assert not [line for line in tune(tmp_path, capsys) if line.startswith("engine:")]
