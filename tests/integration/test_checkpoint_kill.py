"""A learner killed with SIGKILL in the middle of writing a checkpoint resumes from the previous complete
one: model and AdamW state exactly as saved, RNG streams, step counter and buffer offset; and the next save
over the half-written directory succeeds.

The trainer is a spawned one-rank gloo process: it saves step 1, records what it saved, trains step 2 and
starts saving it, but its shards are followed by a hang (a patched dcp.save), so the test kills it while
`step_00000002.partial/` holds shards and no meta.json."""

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncrl.config import load_config
from asyncrl.config.algorithm import AlgorithmConfig
from learner.loop_state import resume_state
from learner.maths.batching import collate
from learner.policy.checkpoint import CHECKPOINTS_DIR, META_FILE, latest_checkpoint, save_checkpoint
from learner.policy.policy_model import load_policy
from learner.policy.train_step import Passes, train_step
from learner_helpers import gathered_weights, random_groups, save_tiny_model, single_rank_world
from waiting import wait_until

pytestmark = pytest.mark.slow

BUFFER_OFFSETS = {1: 17, 2: 35}  # buffer position after each step's batch
LEARNING_RATE = 0.01
MICRO_BATCH_TOKENS = 4096
GRAD_CLIP = 1.0
STARTUP_DEADLINE_S = 300  # spawn, imports, two train steps and a checkpoint on a busy shared 2-core box
POLL_S = 0.2  # between two looks for the trainer's marker file
HANG_S = 600  # the patched save blocks this long at most; the test kills it long before


def optimizer_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's per-parameter state by parameter name, as full tensors."""
    full = {}
    for name, parameter in model.named_parameters():
        entry = optimizer.state[parameter]
        full[name] = {key: value.full_tensor() if hasattr(value, "full_tensor") else value for key, value in entry.items()}
    return full


def train(model, optimizer, world, step: int) -> None:
    outcome = train_step(model, optimizer, collate(random_groups(step), 0), AlgorithmConfig(), Passes(MICRO_BATCH_TOKENS),
                         GRAD_CLIP, world)
    assert outcome.finite


def save_then_hang(state_dict, checkpoint_id: str, real_save, marker: Path) -> None:
    real_save(state_dict, checkpoint_id=checkpoint_id)
    marker.write_text(checkpoint_id)
    time.sleep(HANG_S)  # the behaviour under test: a save that is killed before it completes


def trainer(model_dir: str, run_dir: str, expected_file: str, marker: str) -> None:
    """Spawned: save step 1 and record it, then die (killed) while saving step 2."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    with single_rank_world() as world:
        model = load_policy(model_dir, "float32", load_config().learner, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        train(model, optimizer, world, step=1)
        save_checkpoint(root, 1, model, optimizer, {"buffer_offset": BUFFER_OFFSETS[1]}, world, keep=2)
        torch.save({"weights": gathered_weights(model), "optimizer": optimizer_state(model, optimizer),
                    "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}, expected_file)
        torch.rand(8)  # move both RNG streams past the saved state
        random.random()
        train(model, optimizer, world, step=2)
        real_save = dcp.save
        dcp.save = lambda state, checkpoint_id: save_then_hang(state, checkpoint_id, real_save, Path(marker))
        save_checkpoint(root, 2, model, optimizer, {"buffer_offset": BUFFER_OFFSETS[2]}, world, keep=2)


def kill_during_second_save(model_dir: Path, run_dir: Path, expected_file: Path) -> None:
    marker = run_dir / "second_save_shards_written"
    process = multiprocessing.get_context("spawn").Process(
        target=trainer, args=(str(model_dir), str(run_dir), str(expected_file), str(marker)))
    process.start()
    try:
        wait_until(marker.exists, STARTUP_DEADLINE_S, "the trainer's second save", poll_s=POLL_S,
                   give_up=lambda: None if process.is_alive() else f"trainer exited with code {process.exitcode}")
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=STARTUP_DEADLINE_S)
        assert process.exitcode == -signal.SIGKILL
    finally:
        if process.is_alive():  # a failed wait above: never leave the hanging trainer behind
            process.kill()
            process.join()


def test_kill_during_save_resumes_from_previous_checkpoint_exactly(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    expected_file = tmp_path / "expected_step1.pt"
    kill_during_second_save(model_dir, run_dir, expected_file)

    root = run_dir / CHECKPOINTS_DIR
    partial = root / "step_00000002.partial"
    assert any(partial.glob("*.distcp")) and not (partial / META_FILE).exists()  # killed mid-save
    assert latest_checkpoint(root) == root / "step_00000001"

    expected = torch.load(expected_file)
    config = load_config(overrides=["learner.resume=auto", f"model.path={model_dir}"])
    with single_rank_world() as world:
        model = load_policy(str(model_dir), "float32", config.learner, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        state = resume_state(config, run_dir, model, optimizer, world)
        assert (state.step, state.buffer_offset) == (1, BUFFER_OFFSETS[1])
        assert torch.equal(torch.get_rng_state(), expected["torch_rng"])
        assert random.getstate() == expected["python_rng"]
        for name, value in gathered_weights(model).items():
            assert torch.equal(value, expected["weights"][name]), name
        restored = optimizer_state(model, optimizer)
        assert restored.keys() == expected["optimizer"].keys()
        for name, moments in expected["optimizer"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(restored[name][key], moments[key]), (name, key)
        assert any(moments["exp_avg"].abs().sum() > 0 for moments in restored.values())

        train(model, optimizer, world, step=2)  # the resumed run carries on and saves over the partial
        save_checkpoint(root, 2, model, optimizer, {"buffer_offset": BUFFER_OFFSETS[2]}, world, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    assert latest_checkpoint(root) == root / "step_00000002"
