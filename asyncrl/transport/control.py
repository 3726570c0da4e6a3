"""The weight-sync control channel's sockets: the learner's ROUTER and each rollout server's DEALER.

The buffer's rule holds here too, through the same code: a bind on a non-loopback address needs CURVE
keys, and with keys only clients holding an authorised key get through. One key set serves the whole
job (`buffer.curve_dir`, written by `asyncrl keygen`): every host that talks to the buffer talks to the
learner too, so a second directory to copy around would protect nothing more.
"""

from __future__ import annotations

import zmq.asyncio

from asyncrl.net import split_tcp_endpoint
from asyncrl.transport.sockets import ServingRouter, connect_dealer

# inbound frames are heartbeats, telemetry and round replies, a few kB each; past this a peer is cut off
CONTROL_MAX_MESSAGE_BYTES = 2**20


def bind_control(endpoint: str, curve_dir: str = "") -> ServingRouter:
    """The coordinator's ROUTER at `endpoint` (tcp://host:port, port 0 or * = any free port). A non-loopback
    host without `curve_dir` is refused with a ValueError naming buffer.curve_dir."""
    host, port = split_tcp_endpoint(endpoint)
    return ServingRouter(host, port, CONTROL_MAX_MESSAGE_BYTES, curve_dir)


def connect_control(address: str, curve_dir: str = "") -> zmq.asyncio.Socket:
    """A rollout server's asyncio DEALER to the coordinator at `address`, with the job's client key when
    `curve_dir` is set (a coordinator with keys admits no one else)."""
    return connect_dealer(zmq.asyncio.Context.instance(), address, curve_dir)
