"""Small networking helpers shared by the roles and their launchers: addresses, endpoints, free ports."""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"
LOOPBACK_NAMES = ("localhost",)


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


def is_loopback(host: str) -> bool:
    """True for loopback addresses and names (binding there needs no CURVE keys)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """`tcp://host:port` as (host, port); port `*` or 0 means any free port (returned as 0)."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not host or not (port == "*" or port.isdigit()):
        raise ValueError(f"'{endpoint}' must look like tcp://host:port")
    return host, 0 if port == "*" else int(port)
