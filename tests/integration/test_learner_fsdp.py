"""FSDP2 over two gloo ranks computes the same loss and update as one process on the same batch, with LoRA too."""

import random

import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.sections import LoraConfig, TinyModelConfig
from asyncrl.messages import Trajectory, TrajectoryGroup
from demo.tiny.model import build_tiny_model
from demo.tiny.tokenizer import build_char_tokenizer
from learner.distributed import spawner_store
from learner.maths.batching import collate
from learner.policy.policy_model import load_policy
from learner.policy.train_step import Passes, train_step
from learner_helpers import end_rank, gathered_weights, spawned_rank_world

pytestmark = pytest.mark.slow
BF16_UPDATE_TOLERANCE = 0.05  # relative norm of the update difference allowed between 1 and 2 bf16 ranks


def make_groups() -> list[TrajectoryGroup]:
    rng = random.Random(0)
    groups = []
    for g in range(3):  # 5 rows: the ranks get 3 and 2, so their micro-batch counts can differ (padding passes)
        samples = []
        for _ in range(2 if g < 2 else 1):
            prompt = [rng.randrange(4, 100) for _ in range(rng.randint(3, 8))]
            n = rng.randint(2, 9)
            samples.append(Trajectory(
                prompt, [rng.randrange(4, 100) for _ in range(n)], [rng.uniform(-4, -0.5) for _ in range(n)],
                [0] * n, [rng.choice([1, 1, 0]) for _ in range(n)], float(rng.random() > 0.5), f"g{g}", "a", "stop",
            ))
        groups.append(TrajectoryGroup(f"r{g}", f"g{g}", "s", samples))
    return groups


# What a rank trains, by name: (loss, packed micro-batches, LoRA adapters). Every variant trains in the same two
# processes (one spawn of each world for them all: a spawned rank's start is most of a variant's time on the CPU).
Variant = tuple[str, bool, LoraConfig | None]
LORA = LoraConfig(enabled=True, rank=4, target_modules=["q_proj", "o_proj", "down_proj"])
CPU_VARIANTS: dict[str, Variant] = {
    "decoupled_ppo": ("decoupled_ppo", False, None),
    "naive_ppo": ("naive_ppo", False, None),
    "decoupled_ppo-packed": ("decoupled_ppo", True, None),
    "lora": ("decoupled_ppo", False, LORA),
}
CPU_SHAPE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def worker(rank: int, size: int, port: int, model_dir: str, out: str, variants: dict[str, Variant],
           device: str = "cpu") -> None:
    """Spawned rank: one SGD step of each variant from the saved model; rank 0 saves each one's metrics and weights."""
    torch.set_num_threads(1)
    world = spawned_rank_world(rank, size, port, device)
    results = {}
    for name, (loss, packed, lora) in variants.items():
        torch.manual_seed(0)  # the adapters' A matrices start random
        model = load_policy(model_dir, "float32", LearnerConfig(mixed_precision=True), world, lora)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        algorithm = AlgorithmConfig(loss=loss, grpo_std_norm=False)
        outcome = train_step(model, optimizer, collate(make_groups(), 0), algorithm, Passes(24, packed=packed), 0.0,
                             world)
        results[name] = {"metrics": outcome.metrics, "state": gathered_weights(model)}
    if rank == 0:
        torch.save(results, out)
    end_rank()  # with its peer, and without the teardown that aborted now and then


def run(size: int, model_dir, out, variants: dict[str, Variant], device: str = "cpu") -> dict[str, dict]:
    store = spawner_store(size)
    mp.start_processes(worker, args=(size, store.port, str(model_dir), str(out), variants, device),
                       nprocs=size, start_method="spawn")
    return torch.load(out)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def one_and_two_ranks(tmp_path_factory) -> tuple[dict[str, dict], dict[str, dict]]:
    """Every CPU variant trained by one process and by two gloo ranks, from the same saved model."""
    tmp = tmp_path_factory.mktemp("fsdp")
    build_tiny_model(CPU_SHAPE, build_char_tokenizer(), seed=0).save_pretrained(tmp / "model")
    return (run(1, tmp / "model", tmp / "one.pt", CPU_VARIANTS), run(2, tmp / "model", tmp / "two.pt", CPU_VARIANTS))


@pytest.mark.parametrize("variant", ["decoupled_ppo", "naive_ppo", "decoupled_ppo-packed"])
def test_two_ranks_equal_one_process(one_and_two_ranks, variant):
    single, double = (results[variant] for results in one_and_two_ranks)
    assert single["metrics"]["actor/pg_loss"] == pytest.approx(double["metrics"]["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert single["metrics"]["actor/pg_loss"] != 0.0
    initial = build_tiny_model(CPU_SHAPE, build_char_tokenizer(), seed=0).state_dict()
    moved = 0
    for name, value in single["state"].items():
        torch.testing.assert_close(double["state"][name], value, rtol=1e-4, atol=1e-6)
        moved += int(not torch.equal(value, initial[name]))
    assert moved > len(initial) // 2  # the step really changed the weights (SGD, lr 1: update = gradient)


def test_two_ranks_train_lora_adapters_as_one_process(one_and_two_ranks):
    """The adapters shard with their decoder layers and train as in one process; B starts at zero, so the step shows
    in every B."""
    single, double = (results["lora"] for results in one_and_two_ranks)
    assert single["metrics"]["actor/pg_loss"] == pytest.approx(double["metrics"]["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert len(single["state"]) == 2 * 3 * 2  # layers x targets x (A, B): the adapters alone
    for name, value in single["state"].items():
        torch.testing.assert_close(double["state"][name], value, rtol=1e-4, atol=1e-6)
    assert all(value.abs().max() > 0 for name, value in single["state"].items() if ".lora_B." in name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpu_ranks_nccl_bf16_match_one_gpu(tmp_path):
    """NCCL + bf16 mixed precision (fp32 master weights and reduction): two ranks update like one.

    bf16 compute on differently shaped micro-batches rounds differently, so the comparison is of the
    weight updates as a whole (relative norm of the difference), not bit for bit."""
    tokenizer = build_char_tokenizer()
    shape = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    build_tiny_model(shape, tokenizer, seed=0).save_pretrained(tmp_path / "model")
    variants = {"decoupled_ppo": CPU_VARIANTS["decoupled_ppo"]}
    single = run(1, tmp_path / "model", tmp_path / "one.pt", variants, "cuda")["decoupled_ppo"]
    double = run(2, tmp_path / "model", tmp_path / "two.pt", variants, "cuda")["decoupled_ppo"]
    assert single["metrics"]["actor/pg_loss"] == pytest.approx(double["metrics"]["actor/pg_loss"], rel=1e-2)
    initial = build_tiny_model(shape, tokenizer, seed=0).state_dict()
    for name, value in single["state"].items():
        assert value.dtype == torch.float32  # master weights stay fp32 under mixed precision
        update_one, update_two = value - initial[name], double["state"][name] - initial[name]
        if update_one.abs().max() > 0:
            assert relative_error(update_two, update_one) < BF16_UPDATE_TOLERANCE, name
