"""A LoRA learner (`model.lora`) under FSDP2 on one gloo rank: it learns, its checkpoints hold the adapter and the
adapter's optimizer state only, a run resumed from one continues exactly as the run that went on, and `asyncrl
export` writes the adapter in PEFT's layout (and, with --merged, the merged model) that scores as the learner did."""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from asyncrl.config import AsyncRLConfig, load_config, save_config
from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.sections import LoraConfig
from asyncrl.messages import TrajectoryGroup
from launch import cli
from launch.commands import export as export_command
from learner.maths import attention
from learner.maths.batching import collate
from learner.maths.logprobs import target_logprobs
from learner.policy.checkpoint import CHECKPOINTS_DIR
from learner.policy.export import MERGED_DIR
from learner.policy.lora import add_adapters, is_adapter_weight
from learner.policy.policy_model import shard_policy
from learner.policy.policy_trainer import PolicyTrainer
from learner.policy.train_step import Passes, train_step
from learner_helpers import gathered_weights, random_groups, save_tiny_model, single_rank_world

pytestmark = pytest.mark.slow

STEPS, SAVED_AT = 4, 2
LR = 0.02  # moves a rank-4 adapter visibly in a few steps
TARGETS = ("q_proj", "v_proj", "up_proj")  # 2 layers x 3 targets x (A, B) = 12 adapter matrices
PROMPT = [[5, 17, 33, 9, 40, 12]]
EXPORT_TIMEOUT_S = 180


def lora_config(model_dir: Path, run_dir: Path) -> AsyncRLConfig:
    return load_config(overrides=[
        f"model.path={model_dir}", "model.dtype=float32", "learner.device=cpu", "learner.micro_batch_tokens=4096",
        f"run.root_dir={run_dir.parent}", f"run.name={run_dir.name}", "model.lora.enabled=true", "model.lora.rank=4",
        "model.lora.alpha=8", f"model.lora.target_modules=[{','.join(TARGETS)}]", "learner.keep_checkpoints=5",
    ])


def batch(step: int) -> list[TrajectoryGroup]:
    return random_groups(step, groups=2, samples=4)


def optimizer_state(trainer: PolicyTrainer) -> list[torch.Tensor]:
    return [value.full_tensor() if hasattr(value, "full_tensor") else value
            for state in trainer.optimizer.state.values() for value in state.values()]


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROMPT)).logits  # [1, T, V]


@dataclass
class LoraRuns:
    run_dir: Path
    model_dir: Path
    checkpoint: Path  # saved after step SAVED_AT
    trainable: int  # parameters the optimizer steps
    through: dict  # the run that went on: adapter, optimizer state and step metrics after STEPS
    resumed: dict  # the same, for the run restored from `checkpoint`
    at_checkpoint_logits: torch.Tensor  # the policy's logits at the checkpoint
    rewarded_gap: list[float]  # per step: mean log-prob of rewarded minus unrewarded completions, before the step


def finished(trainer: PolicyTrainer, metrics: list[dict]) -> dict:
    return {"adapter": gathered_weights(trainer.model), "optimizer": optimizer_state(trainer), "metrics": metrics}


def rewarded_gap(trainer: PolicyTrainer, groups: list[TrajectoryGroup]) -> float:
    """How much more likely the policy makes the completions rewarded 1 than those rewarded 0 (per-token mean)."""
    data = collate(groups, trainer.pad_id)
    with torch.no_grad():
        scored, _ = target_logprobs(trainer.model, data.input_ids, data.attention_mask, with_entropy=False)
    per_sample = (scored * data.loss_mask).sum(1) / data.loss_mask.sum(1)  # [B]
    return float(per_sample[data.rewards == 1].mean() - per_sample[data.rewards == 0].mean())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> LoraRuns:
    tmp = tmp_path_factory.mktemp("lora")
    model_dir, run_dir = save_tiny_model(tmp / "model"), tmp / "runs" / "lora"
    config = lora_config(model_dir, run_dir)
    save_config(config, run_dir)
    with single_rank_world() as world:
        trainer = PolicyTrainer.load(config, world)
        trainable = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
        metrics, gaps = [], []
        for step in range(1, STEPS + 1):
            gaps.append(rewarded_gap(trainer, batch(1)))
            metrics.append(trainer.train(batch(1 if step <= SAVED_AT else step), LR).metrics)
            if step == SAVED_AT:
                checkpoint = trainer.save(run_dir / CHECKPOINTS_DIR, step, {"buffer_offset": step})
                at_checkpoint = logits(trainer.model)
        through = finished(trainer, metrics[SAVED_AT:])
        resumed_trainer = PolicyTrainer.load(config, world)
        assert resumed_trainer.restore(checkpoint)["step"] == SAVED_AT
        resumed_metrics = [resumed_trainer.train(batch(step), LR).metrics for step in range(SAVED_AT + 1, STEPS + 1)]
        resumed = finished(resumed_trainer, resumed_metrics)
    return LoraRuns(run_dir, model_dir, checkpoint, trainable, through, resumed, at_checkpoint, gaps)


def test_a_lora_learner_learns_the_rewarded_completions(runs):
    # the first SAVED_AT steps train on one batch: its rewarded completions become likelier than the others
    assert runs.rewarded_gap[SAVED_AT] > runs.rewarded_gap[0] + 0.05


def test_only_the_adapters_reach_the_optimizer(runs):
    # per layer, rank 4: q_proj 64 -> 64, v_proj 64 -> 32, up_proj 64 -> 128 each hold 4 x (in + out)
    assert runs.trainable == 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 128))


def test_the_checkpoint_holds_the_adapter_and_its_optimizer_state_only(runs):
    stored = FileSystemReader(str(runs.checkpoint)).read_metadata().state_dict_metadata
    weights = [key for key in stored if key.startswith("model.")]
    moments = [key for key in stored if key.startswith("optim.state.") and key.endswith("exp_avg")]
    assert len(weights) == 2 * 2 * len(TARGETS) and all(is_adapter_weight(key) for key in weights)
    assert sorted(moment.split(".", 2)[2].rsplit(".", 1)[0] for moment in moments) == sorted(w[len("model."):] for w in weights)


def test_a_run_resumed_from_a_lora_checkpoint_continues_exactly(runs):
    through, resumed = runs.through, runs.resumed
    assert through["metrics"] == resumed["metrics"]
    assert list(through["adapter"]) == list(resumed["adapter"])
    assert all(torch.equal(through["adapter"][name], resumed["adapter"][name]) for name in through["adapter"])
    assert len(through["optimizer"]) == len(resumed["optimizer"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(through["optimizer"], resumed["optimizer"]))


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", "export", *args], capture_output=True, text=True,
                          timeout=EXPORT_TIMEOUT_S)


def test_export_writes_the_adapter_in_peft_layout_and_the_merged_model(runs, tmp_path):
    done = export(str(runs.run_dir), "--checkpoint", str(runs.checkpoint), "--out", str(tmp_path), "--merged")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"EXPORT_DIR {tmp_path}"
    settings = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (settings["peft_type"], settings["r"], settings["lora_alpha"]) == ("LORA", 4, 8)
    assert sorted(settings["target_modules"]) == sorted(TARGETS)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs.model_dir), tmp_path).eval()
    assert torch.allclose(logits(adapted), runs.at_checkpoint_logits, atol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / MERGED_DIR).eval()
    assert torch.allclose(logits(merged), runs.at_checkpoint_logits, atol=1e-5)
    assert not torch.allclose(logits(AutoModelForCausalLM.from_pretrained(runs.model_dir)), runs.at_checkpoint_logits,
                              atol=1e-3)  # the adapter changed the policy


def test_merged_export_of_a_run_without_lora_is_refused(runs, tmp_path, capsys):
    args = cli.parse(["export", str(runs.run_dir), "--out", str(tmp_path), "--merged", "model.lora.enabled=false"])
    assert export_command.main(args) == 1
    assert "--merged needs a LoRA run (model.lora.enabled)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_frozen_bfloat16_base_trains_float32_adapters_under_fsdp2(tmp_path):
    """What a GPU learner with mixed precision holds (`frozen_base_dtype`): FSDP2 takes units whose frozen weights
    and trained weights differ in dtype (torch checks the trained ones only), and the adapters stay float32."""
    model_dir = save_tiny_model(tmp_path / "model")
    with single_rank_world() as world:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                    attn_implementation=attention.register())
        lora = LoraConfig(enabled=True, rank=4, target_modules=list(TARGETS))
        model = shard_policy(add_adapters(base, list(base.model.layers), lora, torch.float32), LearnerConfig(), world)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        before = gathered_weights(model)
        outcome = train_step(model, optimizer, collate(batch(1), 0), AlgorithmConfig(), Passes(4096), 1.0, world)
        after = gathered_weights(model)
    assert outcome.finite and outcome.metrics["actor/grad_norm"] > 0
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert any(not torch.equal(before[name], after[name]) for name in before)
