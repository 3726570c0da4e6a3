"""Small networking helpers shared by the roles' launchers."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on `host` a moment ago (for a listener that binds it next)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
