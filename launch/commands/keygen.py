"""`asyncrl keygen`: write CURVE certificates for the buffer and its clients into buffer.curve_dir."""

from __future__ import annotations

import argparse

from launch.commands.common import start
from asyncrl.config import ConfigError


def main(args: argparse.Namespace) -> int:
    config, log = start(args, "keygen")
    if not config.buffer.curve_dir:
        raise ConfigError("buffer.curve_dir: set the directory to write the keys into, e.g. buffer.curve_dir=keys")
    from asyncrl.transport.sockets import generate_curve_keys

    directory = generate_curve_keys(config.buffer.curve_dir)
    log.info("wrote CURVE keys to %s: server.key(_secret) for the buffer, client.key(_secret) for clients, "
             "authorized_clients/ for the public keys the buffer accepts", directory)
    return 0
