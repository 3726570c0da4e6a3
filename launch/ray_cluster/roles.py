"""What each role runs: the module, its arguments (the run's config plus the addresses the driver
wired) and its environment. Pure functions of the config; no Ray here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.config import AsyncRLConfig
from asyncrl.endpoints import ENDPOINTS_FILE
from asyncrl.buffer_process import BUFFER_SUBDIR, ENDPOINT_FILE
from rollout_servers.server_logs import server_error_file

CLI_MODULE = "launch.cli"  # buffer and learner ranks run their own `asyncrl` commands
SERVER_MODULE = "launch.ray_cluster.serve_rollout"  # one rollout server with a fixed index
LOGS_DIR = "logs"  # under the run directory: one <role>.out per role process (its whole output)


@dataclass(frozen=True)
class RoleSpec:
    name: str  # actor and log name: buffer, learner-0, rollout-1 ...
    module: str  # run as `python -m module`
    args: list[str]  # its arguments
    env: dict[str, str] = field(default_factory=dict)  # added to the actor's environment
    ready_file: str = ""  # the file it writes once it serves (removed before it starts)
    error_file: str = ""  # where it leaves the error it died of (rollout servers: `rollout_servers.server_logs`)

    def log_path(self, run_dir: Path) -> str:
        return str(run_dir / LOGS_DIR / f"{self.name}.out")


@dataclass(frozen=True)
class RunArgs:
    """The arguments every role shares: the same config file and overrides, one run directory."""

    config_path: str | None
    overrides: list[str]
    run_dir: Path  # absolute

    def common(self) -> list[str]:
        config = ["--config", self.config_path] if self.config_path else []
        return [*config, *self.overrides, f"run.root_dir={self.run_dir.parent}", f"run.name={self.run_dir.name}"]


def buffer_dir(config: AsyncRLConfig, run_dir: Path) -> Path:
    return Path(config.buffer.dir).absolute() if config.buffer.dir else run_dir / BUFFER_SUBDIR


def buffer_role(run: RunArgs, directory: Path, host: str, port: int) -> RoleSpec:
    """`asyncrl buffer` bound to host:port (0 = a free port; a restart passes the first one's)."""
    args = ["buffer", *run.common(), f"buffer.dir={directory}", f"buffer.bind_host={host}", f"buffer.port={port}"]
    return RoleSpec("buffer", CLI_MODULE, args, ready_file=str(directory / ENDPOINT_FILE))


def learner_role(run: RunArgs, config: AsyncRLConfig, rank: int, master: tuple[str, int], buffer_address: str,
                 host: str) -> RoleSpec:
    """`asyncrl learner` as one rank of a torchrun-style world; rank 0 serves weight sync on `host`."""
    control_port = config.rollout.weight_sync.control_bind.rsplit(":", 1)[1]
    args = ["learner", *run.common(), f"buffer.address={buffer_address}",
            f"rollout.weight_sync.control_bind=tcp://{host}:{control_port}", f"rollout.weight_sync.host={host}"]
    env = {"RANK": str(rank), "WORLD_SIZE": str(config.learner.nproc), "LOCAL_RANK": "0",  # Ray shows each rank its own GPUs
           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
    ready = str(run.run_dir / ENDPOINTS_FILE) if rank == 0 else ""
    return RoleSpec(f"learner-{rank}", CLI_MODULE, args, env, ready)


def rollout_role(run: RunArgs, index: int, buffer_address: str, sync_address: str) -> RoleSpec:
    args = ["--index", str(index), *run.common(), f"buffer.address={buffer_address}",
            f"rollout.weight_sync.control_address={sync_address}"]
    return RoleSpec(f"rollout-{index}", SERVER_MODULE, args, error_file=str(server_error_file(run.run_dir, index)))
