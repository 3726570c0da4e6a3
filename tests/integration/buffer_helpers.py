"""Helpers of the buffer's integration tests (a module of its own: test files cannot import conftest)."""

from __future__ import annotations

import socket
import time

from asyncrl.transport import BufferConsumer

DRAIN_DEADLINE_S = 60


def free_port() -> int:
    """A loopback port free now (so a restarted buffer can bind the same one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def drain(consumer: BufferConsumer, policy_version: int = 0, quiet_s: float = 0.5) -> list:
    """Every group the consumer can still get, in order, until none arrives for quiet_s."""
    groups = []
    deadline = time.monotonic() + DRAIN_DEADLINE_S
    while time.monotonic() < deadline:
        batch = consumer.next_batch(policy_version, max_samples=64, wait_s=quiet_s)
        if not batch.groups:
            return groups
        groups += batch.groups
    raise TimeoutError("the buffer kept handing out groups past the drain deadline")
