"""The learner's weights: kept in `learner.master_dtype`, shared with the servers in `model.dtype`.

On a one-rank gloo world with the tiny tied model saved in bfloat16 (as the GPU preset's model is)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from learner.distributed import spawner_store
from learner.main import warn_if_updates_round_away
from learner.policy.policy_model import full_weights, full_weights_bytes, load_policy
from learner.services.weight_sharing import WeightSharing
from learner_helpers import end_rank, gathered_weights, save_tiny_model, single_rank_world, spawned_rank_world

TIED = ("model.embed_tokens.weight", "lm_head.weight")


class RecordingServices:
    """Stands in for rank 0's `LearnerConnections`: keeps what each round would broadcast."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, list[tuple[str, torch.Tensor]]]] = []

    def release_weights(self) -> None:
        pass

    def sync_weights(self, version: int, weights: list[tuple[str, torch.Tensor]]):
        self.rounds.append((version, weights))
        return _Report()


class _Report:
    seconds = transfer_seconds = max_server_pause_s = 0.0
    succeeded: list[str] = ["server-0"]
    failed: dict[str, str] = {}


def saved_model(tmp_path, dtype: str = "bfloat16"):
    path = save_tiny_model(tmp_path / "model")
    AutoModelForCausalLM.from_pretrained(path).to(getattr(torch, dtype)).save_pretrained(path)
    return path


def test_float32_master_weights_take_updates_that_bfloat16_rounds_away(tmp_path):
    path = saved_model(tmp_path)
    config = load_config(None, [f"model.path={path}", "model.dtype=bfloat16"])
    assert config.learner.master_dtype == "float32"
    moved = {}
    with single_rank_world() as world:
        for master in ("float32", "bfloat16"):
            model = load_policy(str(path), master, config.learner, world)
            assert {p.dtype for p in model.parameters()} == {getattr(torch, master)}
            before = gathered_weights(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
            for parameter in model.parameters():
                parameter.grad = torch.ones_like(parameter)
            optimizer.step()
            after = gathered_weights(model)
            weight = "model.layers.0.mlp.up_proj.weight"
            moved[master] = (after[weight] != before[weight]).float().mean().item()
    assert moved["float32"] > 0.99  # an AdamW step moves every weight by ~lr
    assert moved["bfloat16"] < 0.2  # most 1e-6 steps are below half a bfloat16 ulp of a weight


@pytest.mark.parametrize("master, warned", [("bfloat16", True), ("float16", True), ("float32", False)])
def test_16_bit_master_weights_are_warned_about(master, warned, caplog):
    warn_if_updates_round_away(load_config(None, [f"learner.master_dtype={master}", "learner.lr=1e-6"]))
    messages = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert bool(messages) == warned
    if warned:
        assert f"learner.master_dtype={master}" in messages[0] and "learner.lr=1e-06" in messages[0]


@pytest.mark.parametrize("served", ["bfloat16", "float32"])
def test_weights_are_shared_in_model_dtype_as_copies_with_the_tied_head_gathered_once(tmp_path, served):
    path = saved_model(tmp_path, served)
    config = load_config(None, [f"model.path={path}", f"model.dtype={served}"])
    services = RecordingServices()
    with single_rank_world() as world:
        model = load_policy(str(path), "float32", config.learner, world)
        sharing = WeightSharing(config, model, world, services)
        assert sharing.device == torch.device("cpu")  # gloo sends from the CPU
        metrics = sharing(7)
        version, sent = services.rounds[0]
        names = [name for name, _ in sent]
        assert version == 7 and names == list(model.state_dict().keys()) and set(TIED) <= set(names)
        tensors = dict(sent)
        assert {t.dtype for t in tensors.values()} == {getattr(torch, served)}
        assert tensors[TIED[0]] is tensors[TIED[1]]  # gathered once, listed under both names
        unique_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors.values()}.values())
        assert full_weights_bytes(model, getattr(torch, served)) == unique_bytes
        master = gathered_weights(model)
        for name, tensor in tensors.items():
            assert torch.equal(tensor, master[name].to(getattr(torch, served))), name
        snapshot = {name: tensor.clone() for name, tensor in tensors.items()}
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)  # training on must not reach what was sent as version 7
        for name, tensor in tensors.items():
            assert torch.equal(tensor, snapshot[name]), name
        assert metrics["weight_sync/servers_ok"] == 1.0 and 0.0 < metrics["weight_sync/gather_seconds"] < 60.0


def test_ranks_that_do_not_keep_the_weights_get_none(tmp_path):
    path = save_tiny_model(tmp_path / "model")
    config = load_config(None, [f"model.path={path}"])
    with single_rank_world() as world:
        model = load_policy(str(path), "float32", config.learner, world)
        assert full_weights(model, torch.float32, torch.device("cpu"), keep=False) == []
        assert WeightSharing(config, model, world, services=None)(1) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("staging_bytes", [8 * 2**30, 0])
def test_on_a_gpu_the_weights_are_gathered_onto_it_when_they_fit(tmp_path, staging_bytes):
    path = saved_model(tmp_path)
    config = load_config(None, [f"model.path={path}", "model.dtype=bfloat16", "rollout.weight_sync.backend=auto",
                                f"rollout.weight_sync.staging_bytes={staging_bytes}"])
    services = RecordingServices()
    with single_rank_world("cuda") as world:
        model = load_policy(str(path), "float32", config.learner, world)
        sharing = WeightSharing(config, model, world, services)
        sharing(1)
        sent = dict(services.rounds[0][1])
        expected = world.device if staging_bytes else torch.device("cpu")
        assert {(t.device, t.dtype) for t in sent.values()} == {(expected, torch.bfloat16)}
        for name, parameter in model.state_dict().items():
            assert torch.equal(sent[name].cpu(), parameter.full_tensor().to(torch.bfloat16).cpu()), name


def sharing_rank(rank: int, size: int, port: int, model_dir: str, out: str) -> None:
    """Spawned CUDA rank: share the weights once; rank 0 saves what it sent and the master weights."""
    world = spawned_rank_world(rank, size, port, "cuda")
    config = load_config(None, [f"model.path={model_dir}", "model.dtype=bfloat16", "rollout.weight_sync.backend=nccl"])
    model = load_policy(model_dir, "float32", config.learner, world)
    services = RecordingServices() if world.is_main else None
    metrics = WeightSharing(config, model, world, services)(1)
    master = gathered_weights(model)  # a collective too
    if world.is_main:
        sent = services.rounds[0][1]
        torch.save({"devices": {(str(t.device), t.dtype) for _, t in sent}, "sent": {n: t.cpu() for n, t in sent},
                    "master": master}, out)
    else:
        assert metrics == {}
    end_rank()  # with its peers, and without the teardown that aborted now and then


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpu_ranks_gather_onto_rank_0s_gpu_in_model_dtype(tmp_path):
    path = saved_model(tmp_path)
    out = tmp_path / "sent.pt"
    store = spawner_store(2)
    mp.start_processes(sharing_rank, args=(2, store.port, str(path), str(out)), nprocs=2, start_method="spawn")
    result = torch.load(out)
    assert result["devices"] == {("cuda:0", torch.bfloat16)}
    assert result["sent"].keys() == result["master"].keys()
    for name, tensor in result["sent"].items():
        assert torch.equal(tensor, result["master"][name].to(torch.bfloat16)), name
