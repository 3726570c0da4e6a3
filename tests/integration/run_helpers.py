"""Helpers of the tests that run the whole job (`asyncrl run`) as real processes: the tiny job's
overrides, the CLI as a subprocess, and the process tree of a running job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

RUN_TIMEOUT_S = 900  # one tiny job on the loaded 2-core box, engine start included
# The response's length as its reward (tests/fixtures/length_reward.py): rewards differ inside every group, and a
# barely trained model learns it in a few steps.
LENGTH_REWARD = (f"reward.custom_fn.path={Path(__file__).parents[1] / 'fixtures' / 'length_reward.py'}",
                 "reward.custom_fn.name=compute_score")


def tiny_job(tmp: Path, total_steps: int, *extra: str) -> list[str]:
    """Overrides of a tiny job: 1-digit arithmetic, a 64-wide model, short completions, wandb off."""
    return [
        f"run.root_dir={tmp / 'runs'}", "metrics.wandb_mode=disabled",
        f"model.path={tmp / 'model'}", "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.tiny.num_layers=2", "model.tiny.intermediate_size=128", "model.warm_start.steps=20",
        "model.warm_start.eval_samples=8", f"task.out_dir={tmp / 'data'}", "task.num_train=200", "task.num_val=16",
        "task.max_digits=1", "buffer.admission_timeout_s=15", f"data.train_files=[{tmp / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp / 'data' / 'val.parquet'}]", f"learner.total_steps={total_steps}", "learner.lr=0.001",
        "learner.torch_threads=1", "rollout.engine.cpu_threads=1", "rollout.sampling.max_tokens=6",
        "rollout.engine.max_model_len=64", "rollout.engine.dtype=float32", *extra,
    ]


def learning_script_job(tmp: Path, total_steps: int) -> list[str]:
    """Overrides of a tiny job for a script that places its runs itself (no run.root_dir): the length reward at a
    rate that a handful of steps shows rising, four groups of four a step, held-out scores of two samples."""
    overrides = [item for item in tiny_job(tmp, total_steps) if not item.startswith("run.root_dir=")]
    return overrides + ["task.min_digits=1", "learner.lr=0.01", "validation.n=2", "validation.k=2", *LENGTH_REWARD,
                        "buffer.batch_groups=4", "rollout.sampling.n=4"]


def asyncrl(*args: str) -> subprocess.CompletedProcess:
    """Run one asyncrl command to completion."""
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def prepare(tmp: Path, overrides: list[str]) -> None:
    """Write the task files and build the warm-started tiny model for `overrides`."""
    for command in ("data", "init-model"):
        done = asyncrl(command, *overrides)
        assert done.returncode == 0, done.stderr[-3000:]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children of children included), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = _parent_pid(entry)
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, frontier = set(), [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids in `pids` that still exist and are not zombies."""
    return {pid for pid in pids if _state(pid) not in (None, "Z")}


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it (a failed test must not leave a job running)."""
    for member in descendants(pid) | {pid}:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _parent_pid(proc_entry: Path) -> int | None:
    try:
        stat = (proc_entry / "stat").read_text()
    except OSError:  # exited while listing
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state, ppid, ...


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
