"""Where a run's services listen, shared through the run directory, and the end of the run.

The learner's services (its buffer, its weight-sync coordinator) listen on the same ports at every start of a
run: ports the config leaves at 0 are chosen free at the first start and kept in the run directory, so a
restarted learner (`learner.resume=auto`) comes back where its rollout servers look for it, and they carry on
with their engines instead of restarting them."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from asyncrl.net import port_is_free
from asyncrl.whole_files import write_json_whole

log = logging.getLogger(__name__)

PORT_WAIT_S = 10.0  # how long a restarted learner waits for its run's port (held by its killed predecessor's
# children, which die with it, on a loaded box a moment later) before it takes a free one
PORT_POLL_S = 1.0  # between two looks at that port
PORTS_FILE = "ports.json"  # {"buffer": port, "sync": port}: the ports the learner's services bound in this run
ENDPOINTS_FILE = "endpoints.json"  # written by learner rank 0: {"buffer": "tcp://...", "sync": "tcp://..."}
FINISHED_KEY = "finished"  # once the learner has trained its last step the file holds {"finished": final version}


def read_endpoints(run_dir: Path) -> dict | None:
    """The run's endpoints file, or None while there is none (the learner has not yet bound its services)."""
    try:
        return json.loads((Path(run_dir) / ENDPOINTS_FILE).read_text())
    except FileNotFoundError:
        return None


def write_endpoints(run_dir: Path, found: dict) -> None:
    """Replace the endpoints file at once (a reader never sees half of it)."""
    write_json_whole(Path(run_dir) / ENDPOINTS_FILE, found)


def remembered_ports(run_dir: Path) -> dict[str, int]:
    """The ports the learner's services bound at an earlier start of this run ({} at the first start)."""
    try:
        return json.loads((Path(run_dir) / PORTS_FILE).read_text())
    except FileNotFoundError:
        return {}


def remember_ports(run_dir: Path, addresses: dict[str, str]) -> None:
    """Keep the ports of `addresses` (service -> tcp://host:port) for the learner's next start in this run."""
    write_json_whole(Path(run_dir) / PORTS_FILE,
                     {service: int(address.rpartition(":")[2]) for service, address in addresses.items()})


def port_to_bind(service: str, host: str, configured: int, remembered: int | None,
                 wait_s: float = PORT_WAIT_S) -> int:
    """The port `service` binds on `host`: the configured one; else (0) the one it bound earlier in this run,
    once free (waited for up to `wait_s`); else 0, a free one (the servers then follow the learner to its new
    addresses)."""
    if configured or not remembered:
        return configured
    deadline = time.monotonic() + wait_s
    while not port_is_free(host, remembered):
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            log.warning("the %s's port of this run, %d, is still taken after %.1fs: binding a free one (the rollout "
                        "servers restart on the new addresses)", service, remembered, wait_s)
            return 0
        log.info("the %s's port of this run, %d, is taken (a predecessor still exiting?): trying again in %.1fs",
                 service, remembered, min(PORT_POLL_S, left_s))
        time.sleep(min(PORT_POLL_S, left_s))
    return remembered
