"""`asyncrl data`: write the synthetic task's train and validation files in verl's layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from launch.commands.common import start
from asyncrl.config.sections import TaskConfig
from asyncrl.data import write_rows
from demo.tasks.catalog import task_kind


def write_task_files(task: TaskConfig, seed: int) -> dict[str, Path]:
    """Write train/val files for `task`; validation questions never appear in the training file."""
    kind = task_kind(task)
    problems = kind.split(task, seed)
    out = Path(task.out_dir)
    return {
        split: write_rows(
            (kind.make_row(problem, index, split, task) for index, problem in enumerate(rows)),
            out / f"{split}.{task.format}",
        )
        for split, rows in (("train", problems.train), ("val", problems.val))
    }


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "data")
    paths = write_task_files(config.task, config.run.seed)
    for split, path in paths.items():
        log.info("wrote %s split: %s", split, path)
    print(" ".join(str(path) for path in paths.values()))
    return 0
