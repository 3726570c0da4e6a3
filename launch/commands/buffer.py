"""`asyncrl buffer`: run the trajectory buffer service in this process until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.commands.common import make_run_dir, start
from asyncrl.buffer_process import BUFFER_SUBDIR

COMMAND_LINE = (sys.executable, "-m", "launch.cli", "buffer")  # how another process runs this command


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "buffer")
    directory = Path(config.buffer.dir) if config.buffer.dir else make_run_dir(config, "buffer") / BUFFER_SUBDIR
    from buffer.service import run_buffer

    log.info("starting the buffer in %s", directory)
    try:
        run_buffer(config.buffer, directory)
    except Exception as error:  # the reason and its traceback into the buffer's output, its log
        log.exception("buffer failed: %s: %s", type(error).__name__, error)
        return 1
    return 0
