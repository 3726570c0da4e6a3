"""`asyncrl data`: write the synthetic task's train and validation files in verl's layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from asyncrl.commands.common import start
from asyncrl.config.sections import TaskConfig
from asyncrl.data import write_rows
from asyncrl.tasks import arithmetic
from asyncrl.tasks.splits import split_task


def write_task_files(task: TaskConfig, seed: int) -> dict[str, Path]:
    """Write train/val files for `task`; validation questions never appear in the training file."""
    problems = split_task(task, seed)
    out = Path(task.out_dir)
    return {
        split: write_rows(
            (arithmetic.make_row(q, a, index, split) for index, (q, a) in enumerate(rows)),
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
