"""The long-tailed GPU preset (configs/gpu_longtail.yaml: the scratchpad task, its warm start, its RL settings) on Qwen3's
real tokenizer (model.tiny.tokenizer=qwen3), at CPU size: the preset's own file with only its size and devices
overridden. The data, the warm start in Qwen3's ids, and a step of `asyncrl run` (synchronous: the job's own
generation and training code in one process) go through, and what it trained was rendered by Qwen3's chat template
and sampled from its vocabulary. A real job, run beside the other tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncrl.metrics import read_metrics
from launch.reference_loop import trained_groups
from run_helpers import asyncrl, prepare, tiny_job

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended]

PRESET = "configs/gpu_longtail.yaml"
CHAR_VOCABULARY = 512  # more ids than the character tokenizer has: an id past it is Qwen3's
CPU_SIZE = ["model.tiny.tokenizer=qwen3", "model.warm_start.device=cpu", "model.warm_start.steps=2",
            "model.warm_start.batch_size=4", "model.warm_start.warmup_steps=1", "model.warm_start.eval_samples=2",
            "learner.device=cpu", "learner.micro_batch_tokens=2048", "task.scratchpad.max_size=2",
            "rollout.sampling.max_tokens=48", "rollout.engine.max_model_len=128", "model.tiny.max_position=128",
            "rollout.engine.enforce_eager=true", "rollout.max_inflight=8", "buffer.batch_groups=2",
            "rollout.sampling.n=2", "validation.every=0",
            "learner.mode=synchronous"]  # one process runs the job's own generation and training: the cheapest run


def longtail_qwen3_job(_: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """The preset at CPU size on Qwen3's tokenizer, one step: the finished run and its directory."""
    overrides = ["--config", str(Path(__file__).parents[2] / PRESET), *tiny_job(tmp, 1, *CPU_SIZE)]
    prepare(tmp, overrides)
    return asyncrl("run", *overrides, "run.name=longtail-qwen3"), tmp


REAL_JOBS = [longtail_qwen3_job]  # run side by side with other modules' jobs (conftest.py)


def test_the_long_tailed_preset_trains_on_qwen3_s_tokenizer(real_jobs):
    done, tmp_path = real_jobs[longtail_qwen3_job].result()
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "longtail-qwen3"
    steps = [record for record in read_metrics(run_dir) if "batch/samples" in record]
    assert [record["step"] for record in steps] == [1]

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert len(tokenizer) >= 151_669 and type(tokenizer).__name__.startswith("Qwen2Tokenizer")
    trajectories = [t for group in trained_groups(run_dir, 1) for t in group.trajectories]
    assert trajectories
    for trajectory in trajectories:
        prompt = tokenizer.decode(trajectory.prompt_ids)
        assert prompt.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in prompt
        assert "+" in prompt and "=" in prompt  # a scratchpad problem ("367+398=")
    assert max(token for t in trajectories for token in t.completion_ids) >= CHAR_VOCABULARY
