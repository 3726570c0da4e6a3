from __future__ import annotations

from typing import Callable

import pytest

from asyncrl.launch_buffer import BufferProcess, start_buffer


@pytest.fixture
def buffer_process(tmp_path) -> Callable[..., BufferProcess]:
    """Start `asyncrl buffer` processes on a directory under tmp_path; all are stopped at teardown."""
    started: list[BufferProcess] = []

    def start(*overrides: str, directory=None) -> BufferProcess:
        process = start_buffer(directory or tmp_path / "buffer", overrides=overrides,
                               log_path=tmp_path / "buffer.log", timeout_s=60)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()
