"""The Ray actor that hosts one role process on its node (see process.py) and answers the driver."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray

from launch.ray_cluster.process import RoleProcess
from asyncrl.net import free_port

SECRET_SUFFIX = "_secret"  # CURVE secret key files are written readable by the owner only


@ray.remote
class RoleActor:
    def __init__(self, role: str, cwd: str, curve_keys: dict[str, bytes], grace_s: float) -> None:
        self.role = role
        self.cwd = cwd
        self.grace_s = grace_s
        self.curve_dir = write_keys(curve_keys) if curve_keys else None
        self.process: RoleProcess | None = None

    def __repr__(self) -> str:  # Ray prefixes the lines this actor prints with it
        return self.role

    def where(self) -> dict[str, Any]:
        """This actor's node: the address its role binds, and Ray's node id."""
        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": self.process.pid if self.process else None}

    def free_port(self) -> int:
        return free_port(ray.util.get_node_ip_address())

    def start(self, module: str, args: list[str], env: dict[str, str], log_path: str, stale_file: str = "") -> int:
        """Run `python -m module args` in the driver's working directory; returns its pid. `stale_file`,
        the file the role writes once it serves, is removed first so that an old one is never read."""
        if not Path(self.cwd).is_dir():
            raise RuntimeError(f"{self.role}: working directory {self.cwd} does not exist on node "
                               f"{ray.util.get_node_ip_address()}; asyncrl launch needs the driver's paths on every node")
        if stale_file:
            Path(self.cwd, stale_file).unlink(missing_ok=True)
        curve = [f"buffer.curve_dir={self.curve_dir}"] if self.curve_dir else []
        argv = [sys.executable, "-m", module, *args, *curve]
        self.process = RoleProcess(argv, os.environ | env, self.cwd, Path(self.cwd, log_path), self.grace_s)
        return self.process.pid

    def read_file(self, path: str) -> str | None:
        """The file's text, or None while it does not exist (paths relative to the working directory)."""
        target = Path(self.cwd, path)
        return target.read_text() if target.is_file() else None

    def poll(self) -> int | None:
        """The role's exit code, or None while it runs."""
        return self.process.poll() if self.process else None

    def stop(self) -> int | None:
        code = self.process.stop() if self.process else None
        if self.curve_dir:
            shutil.rmtree(self.curve_dir, ignore_errors=True)
        return code


def read_keys(directory: str | Path) -> dict[str, bytes]:
    """Every file under a CURVE key directory (asyncrl keygen's layout), by relative path."""
    root = Path(directory)
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def write_keys(keys: dict[str, bytes]) -> str:
    """The keys in a fresh private directory on this node; returns its path."""
    root = Path(tempfile.mkdtemp(prefix="asyncrl-curve-"))
    for name, content in keys.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        if name.endswith(SECRET_SUFFIX):
            target.chmod(0o600)
    return str(root)
