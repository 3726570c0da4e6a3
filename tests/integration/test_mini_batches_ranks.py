"""Mini-batches over two gloo ranks: every rank plans the same split, and m2po's cutoff is taken over the whole
mini-batch, every rank's rows included, so two ranks update like one process."""

import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.sections import TinyModelConfig
from demo.tiny.model import build_tiny_model
from demo.tiny.tokenizer import build_char_tokenizer
from learner.distributed import spawner_store
from learner.maths.batching import collate
from learner.policy.policy_model import load_policy
from learner.policy.train_step import Passes, train_step
from learner_helpers import end_rank, gathered_weights, spawned_rank_world
from test_learner_fsdp import make_groups

pytestmark = pytest.mark.slow
# 3 groups of 2, 2 and 1 samples: mini-batches of 4 rows and 1 row, so rank 1 has no row of the second one.
# τ = 2 masks some of the tiny model's tokens (their squared log ratios to the random behaviour reach ~10) and not all.
ALGORITHM = AlgorithmConfig(loss="m2po", m2_threshold=2.0, mini_batches=2, epochs=2, grpo_std_norm=False)


def worker(rank: int, size: int, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    world = spawned_rank_world(rank, size, port)
    model = load_policy(model_dir, "float32", LearnerConfig(), world)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    outcome = train_step(model, optimizer, collate(make_groups(), 0), ALGORITHM, Passes(24), 0.0, world)
    state = gathered_weights(model)
    if rank == 0:
        torch.save({"metrics": outcome.metrics, "state": state}, out)
    end_rank()  # with its peer, and without the teardown that aborted now and then


def run(size: int, model_dir, out) -> dict:
    store = spawner_store(size)
    mp.start_processes(worker, args=(size, store.port, str(model_dir), str(out)), nprocs=size, start_method="spawn")
    return torch.load(out)


def test_two_ranks_with_mini_batches_and_m2po_equal_one_process(tmp_path):
    tokenizer = build_char_tokenizer()
    shape = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    build_tiny_model(shape, tokenizer, seed=0).save_pretrained(tmp_path / "model")
    single = run(1, tmp_path / "model", tmp_path / "one.pt")
    double = run(2, tmp_path / "model", tmp_path / "two.pt")
    assert 0.0 < single["metrics"]["trust_region/masked_frac"] < 1.0
    assert single["metrics"]["actor/optimizer_steps"] == 4.0
    for key in ("actor/pg_loss", "trust_region/m2"):
        assert double["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5, abs=1e-7), key
    for name, value in single["state"].items():
        torch.testing.assert_close(double["state"][name], value, rtol=1e-4, atol=1e-6)
