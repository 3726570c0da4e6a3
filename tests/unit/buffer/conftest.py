from __future__ import annotations

import threading

import pytest

from asyncrl.config.buffer import BufferConfig
from buffer.service import BufferService

SMALL_SEGMENT_BYTES = 4096  # a few small groups per segment, so tests cross segment boundaries


@pytest.fixture
def small_config() -> BufferConfig:
    return BufferConfig(segment_bytes=SMALL_SEGMENT_BYTES, max_staleness="1", batch_groups=4)


@pytest.fixture
def serve(tmp_path):
    """Start a BufferService in a thread of the test process (stopped after the test)."""
    started = []

    def start(config, directory=None):
        service = BufferService(config, directory or tmp_path / f"buffer{len(started)}")
        thread = threading.Thread(target=service.serve, daemon=True)
        thread.start()
        started.append((service, thread))
        return service

    yield start
    for service, thread in started:
        service.stop()
        thread.join(timeout=5)
