"""`asyncrl tune`'s GPU split on hand-built runs: each side's rate read from the step records, every split of the
host's GPUs predicted from them, and the one that keeps the job fastest; the runs that cannot tell say why."""

import pytest

from asyncrl.config import load_config
from launch.gpu_split import MIN_STEPS, RunPlacement, read_rates, split_advice

FOUR_GPUS = ["rollout.num_servers=2", "rollout.gpus=[0,1]", "learner.nproc=2", "learner.gpus=[2,3]"]
STEPS = 18  # as `read_steps` leaves of a 20-step run


def step(delivered: float, idle: float, trained: float, servers: int = 2, train_s: float = 1.0) -> dict[str, float]:
    """A step whose `servers` servers each generated `delivered` tokens/s, idle `idle` of their time, and whose whole
    learner trained `trained` tokens/s of training."""
    record = {"learner/tokens_per_s": trained, "timing_s/train": train_s, "memory/peak_gib": 40.0}
    for index in range(servers):
        record |= {f"rollout/server-{index}/tokens_per_s": delivered, f"rollout/server-{index}/idle_ratio": idle}
    return record


def advice(overrides: list[str], record: dict[str, float], gpus: int | None = None, steps: int = STEPS) -> list[str]:
    return split_advice([record] * steps, load_config(None, overrides), gpus)


def row(line: str) -> list[str]:
    return line.split()


def test_a_generation_bound_run_gets_more_servers():
    # a server 1,000 tokens/s busy (never idle), a rank 8,000 / 2 = 4,000: on 4 GPUs the job runs at
    # min(1,000 s, 4,000 (4 - s)): 1,000 / 2,000 / 3,000 for s = 1 / 2 / 3
    headline, read, model, header, *rows = advice(FOUR_GPUS, step(1000.0, 0.0, 8000.0))
    assert headline == ("split: 3 servers + 1 learner rank (rollout.num_servers=3 learner.nproc=1) on the 4 GPUs "
                        "instead of the run's 2 + 2: the job at 3,000 tokens/s, generation the slower side, 1.50x the "
                        "2,000 predicted for the run's split")
    assert read.startswith("  read over 18 steps: 2 servers on GPUs of their own and 2 learner ranks on 4 GPUs; a "
                           "server generated 1,000 tokens/s while busy (1,000 delivered, idle 0%")
    assert "a learner rank trained 4,000 tokens/s while training (learner/tokens_per_s 8,000 over 2 ranks)" in read
    assert model.startswith("  model: s servers generate s × 1,000 tokens/s, l learner ranks train l × 4,000")
    assert header.split() == ["servers", "ranks", "generation", "tok/s", "training", "tok/s", "job", "tok/s",
                              "servers", "idle", "learner", "waits"]
    # servers idle 1 - job / generation, learner waits 1 - job / training: 1 - 1,000 / 12,000 = 92 %
    assert [row(line) for line in rows] == [["1", "3", "1,000", "12,000", "1,000", "0%", "92%"],
                                            ["2", "2", "2,000", "8,000", "2,000", "0%", "75%", "←", "run"],
                                            ["3", "1", "3,000", "4,000", "3,000", "0%", "25%", "←", "best"]]


def test_a_learner_bound_run_gets_more_learner_ranks():
    # servers idle half their time at 1,500 delivered: 3,000 busy; a rank 1,600 / 2 = 800: min(3,000 s, 800 (4 - s))
    # is 2,400 / 1,600 / 800 for s = 1 / 2 / 3
    headline, _, _, _, *rows = advice(FOUR_GPUS, step(1500.0, 0.5, 1600.0))
    assert headline.startswith("split: 1 server + 3 learner ranks (rollout.num_servers=1 learner.nproc=3) on the "
                               "4 GPUs instead of the run's 2 + 2: the job at 2,400 tokens/s, training the slower side, "
                               "1.50x the 1,600")
    assert row(rows[0]) == ["1", "3", "3,000", "2,400", "2,400", "20%", "0%", "←", "best"]  # 1 - 2,400 / 3,000


def test_a_balanced_run_keeps_its_split():
    # 2 servers × 2,000 = 2 ranks × 2,000: moving a GPU either way halves the slower side
    headline, *_ , one, two, three = advice(FOUR_GPUS, step(2000.0, 0.0, 4000.0))
    assert headline == ("split: keep 2 servers + 2 learner ranks (rollout.num_servers=2 learner.nproc=2) on the 4 "
                        "GPUs: no other split is faster at the run's rates (the job at 4,000 tokens/s, both sides "
                        "matched)")
    assert row(two) == ["2", "2", "4,000", "4,000", "4,000", "0%", "0%", "←", "best,", "run"]
    assert [row(one)[4], row(three)[4]] == ["2,000", "2,000"]


def test_another_host_size_is_split_from_the_same_rates():
    # 8 GPUs at 1,000 per server and 4,000 per rank: s = 6 gives min(6,000, 8,000); s = 5 5,000, s = 7 4,000
    lines = advice(FOUR_GPUS, step(1000.0, 0.0, 8000.0), gpus=8)
    assert lines[0] == ("split: on 8 GPUs, 6 servers + 2 learner ranks (rollout.num_servers=6 learner.nproc=2): "
                        "the job at 6,000 tokens/s, generation the slower side")
    rows = lines[4:]
    assert len(rows) == 7 and not any("run" in line for line in rows)  # s = 1 … 7; the run's split was on 4 GPUs
    assert row(rows[5]) == ["6", "2", "6,000", "8,000", "6,000", "0%", "25%", "←", "best"]


def test_tensor_parallel_servers_take_their_gpus_and_a_tie_keeps_the_runs_split():
    # servers of 2 GPUs on 6: s = 1 (4 ranks) or 2 (2 ranks); 1,000 per server, 500 per rank: 1,000 either way
    overrides = ["rollout.engine.tensor_parallel_size=2", "rollout.num_servers=2", "rollout.gpus=[0,1,2,3]",
                 "learner.nproc=2", "learner.gpus=[4,5]"]
    headline, read, _, _, *rows = advice(overrides, step(1000.0, 0.0, 1000.0))
    assert headline.startswith("split: keep 2 servers + 2 learner ranks (rollout.num_servers=2 learner.nproc=2)")
    assert "2 servers of 2 GPUs on GPUs of their own and 2 learner ranks on 6 GPUs" in read
    assert [row(line)[:5] for line in rows] == [["1", "4", "1,000", "2,000", "1,000"], ["2", "2", "2,000", "1,000", "1,000"]]


def test_a_mixed_run_reads_the_servers_on_gpus_of_their_own():
    # 2 GPUs: server-0 alone on GPU 0, server-1 beside the learner on GPU 1; only server-0's 1,000 tokens/s count
    record = step(1000.0, 0.0, 3000.0, servers=1) | {"rollout/server-1/tokens_per_s": 200.0,
                                                     "rollout/server-1/idle_ratio": 0.8}
    overrides = ["rollout.num_servers=2", "rollout.gpus=[0,1]", "learner.gpus=[1]"]
    headline, read, *_ = advice(overrides, record)
    # under `asyncrl run` on 2 GPUs, rollout.num_servers=2 learner.nproc=1 puts the second server beside the learner
    assert headline.startswith("split: keep 1 server + 1 learner rank (rollout.num_servers=2 learner.nproc=1, 1 server "
                               "of them beside the learner as in the run) on the 2 GPUs")
    assert "(the job at 1,000 tokens/s, generation the slower side)" in headline
    assert "1 server on GPUs of their own (and 1 server beside the learner) and 1 learner rank on 2 GPUs" in read
    assert read.endswith("its learner shared a GPU with 1 server, so a rank of its own may train faster")


def test_the_learners_rate_is_weighted_by_its_training_time():
    # 1,000 tokens/s over 1 s and 4,000 over 3 s: 13,000 tokens in 4 s, 3,250 tokens/s (the plain mean says 2,500)
    steps = [step(1000.0, 0.25, 1000.0, train_s=1.0), step(1000.0, 0.25, 4000.0, train_s=3.0)] * 3
    rates = read_rates(steps, RunPlacement.of(load_config(None, FOUR_GPUS), steps))
    assert (rates.steps, rates.trained, rates.generation) == (6, 3250.0, pytest.approx(1000.0 / 0.75))


@pytest.mark.parametrize("overrides, record, steps, expected", [
    (FOUR_GPUS, {"learner/tokens_per_s": 8000.0, "timing_s/train": 1.0}, STEPS,
     "split: the run logged no rollout/server-0/tokens_per_s, rollout/server-0/idle_ratio, rollout/server-1/tokens_per_s,"
     " rollout/server-1/idle_ratio: it lacks the rates a split is predicted from"),
    (FOUR_GPUS, step(1000.0, 0.0, 8000.0), MIN_STEPS - 1,
     "split: 4 steps after the warm-up logged both sides' rates, and a split needs 5: the run is too short to tell"),
    (FOUR_GPUS, step(1000.0, 0.97, 8000.0), STEPS,
     "split: the servers on GPUs of their own were idle 97% of their time: too little work to show what one generates "
     "when busy"),
    (FOUR_GPUS, step(0.0, 0.0, 8000.0), STEPS,
     "split: the servers generated 0 tokens/s and the learner trained 8,000: a side that made no tokens gives no rate "
     "to scale"),
    ([], {"learner/tokens_per_s": 500.0, "timing_s/train": 1.0}, STEPS,
     "split: the learner ran on the CPU: no GPU split applies"),
    ([], step(1000.0, 0.0, 8000.0), STEPS,
     "split: the run's config.yaml names no GPUs (learner.gpus, rollout.gpus: roles started alone without them, under "
     "torchrun or on Ray): which GPUs each side had is unknown"),
    (["rollout.gpus=[0]", "learner.gpus=[0]"], step(1000.0, 0.0, 8000.0, servers=1), STEPS,
     "split: the learner shared its GPU with every server (GPU plan: learner → [0]; server-0 → [0] (with the learner) "
     "(colocated)): the two sides shared its time, so no split between them applies"),
], ids=["no-server-rates", "too-short", "idle-servers", "no-tokens", "cpu", "no-gpu-lists", "one-shared-gpu"])
def test_a_run_that_cannot_tell_says_why_in_one_line(overrides, record, steps, expected):
    assert advice(overrides, record, steps=steps) == [expected]


def test_a_host_too_small_for_a_server_and_a_rank_says_so():
    assert advice(FOUR_GPUS, step(1000.0, 0.0, 8000.0), gpus=1) == [
        "split: 1 GPU cannot hold a server of 1 GPU and a learner rank on a GPU of its own"]
