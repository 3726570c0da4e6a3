"""`asyncrl data`: write the synthetic task's train and validation files in verl's layout."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from asyncrl.commands.common import start
from asyncrl.config.sections import TaskConfig
from asyncrl.data import write_rows
from asyncrl.tasks import arithmetic


def write_task_files(task: TaskConfig, seed: int) -> dict[str, Path]:
    """Write train/val files for `task`; validation questions never appear in the training file."""
    rng = random.Random(seed)
    val = _draw(rng, task, task.num_val, exclude=set(), unique=True)
    train = _draw(rng, task, task.num_train, exclude={question for question, _ in val}, unique=False)
    out = Path(task.out_dir)
    return {
        split: write_rows(
            (arithmetic.make_row(q, a, index, split) for index, (q, a) in enumerate(problems)),
            out / f"{split}.{task.format}",
        )
        for split, problems in (("train", train), ("val", val))
    }


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "data")
    paths = write_task_files(config.task, config.run.seed)
    for split, path in paths.items():
        log.info("wrote %s split: %s", split, path)
    print(" ".join(str(path) for path in paths.values()))
    return 0


def _draw(rng: random.Random, task: TaskConfig, count: int, exclude: set[str], unique: bool) -> list[tuple[str, str]]:
    """Up to `count` problems whose questions avoid `exclude` (fewer when the task space runs out)."""
    problems: list[tuple[str, str]] = []
    taken: set[str] = set()
    for _ in range(count * _DRAW_ATTEMPTS_PER_PROBLEM):
        question, answer = arithmetic.make_problem(rng, task.min_digits, task.max_digits, task.operators)
        if question in exclude or (unique and question in taken):
            continue
        problems.append((question, answer))
        taken.add(question)
        if len(problems) == count:
            break
    return problems


_DRAW_ATTEMPTS_PER_PROBLEM = 20  # give up drawing when the task space is nearly exhausted
