"""NCCL settings every weight-transfer peer needs before its process creates its first communicator.

NCCL reads these once per process, so the learner command and each rollout server's process (`serve_one`, under
`asyncrl rollout` and `asyncrl launch` alike) apply them at start, before the learner's own NCCL world or vLLM's
engine exists.
Values the user exported are left alone.
- `NCCL_CUMEM_ENABLE=0` on both sides: the two must agree. Older vLLM releases set it in their own processes,
  and a trainer that used cuMem buffers while the vLLM workers did not was seen to hang the weight-transfer
  rendezvous (see docs/weight_sync.md); vLLM 0.24 no longer sets it, and a server process that left it unset
  under Ray (NCCL's default, cuMem on) failed every broadcast from a learner that had it off with
  "Cuda failure 'invalid argument'" (4 x H200, 2026-11-26).
- `NCCL_SOCKET_IFNAME=lo` when the group meets on a loopback address: otherwise NCCL's bootstrap may
  advertise another interface (a VM's external address) that the peers on this host cannot reach.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

log = logging.getLogger(__name__)

LOOPBACK_INTERFACE = "lo"


def prepare_nccl_environment(group_host: str) -> dict[str, str]:
    """Set the NCCL variables for a weight-transfer group meeting at `group_host`; return those set."""
    wanted = {"NCCL_CUMEM_ENABLE": "0"}
    if _is_loopback(group_host):
        wanted["NCCL_SOCKET_IFNAME"] = LOOPBACK_INTERFACE
    applied = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(applied)
    if applied:
        log.debug("NCCL environment for the weight-transfer group: %s", applied)
    return applied


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):  # unresolvable here: not ours to decide, NCCL picks its interface
        return False
