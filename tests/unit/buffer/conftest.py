from __future__ import annotations

import pytest

from asyncrl.config.buffer import BufferConfig

SMALL_SEGMENT_BYTES = 4096  # a few small groups per segment, so tests cross segment boundaries


@pytest.fixture
def small_config() -> BufferConfig:
    return BufferConfig(segment_bytes=SMALL_SEGMENT_BYTES, max_staleness=1, batch_groups=4)
