"""Small networking helpers shared by the roles' launchers."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on `host` a moment ago (for a listener that binds it next)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether a listener could bind `port` on `host` now. With SO_REUSEADDR, as ZeroMQ binds: the port of a
    killed listener whose connections linger in TIME_WAIT counts as free."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
