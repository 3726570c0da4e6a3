"""The driver of `asyncrl launch`: reserve the roles' resources, start the buffer, the learner ranks and
the rollout servers as Ray actors in that order (each stage needs the addresses the previous one
reported), watch them, restart rollout servers and the buffer when they die, fail the run when a
learner rank does, and stop everything on the way out (finish, failure, Ctrl-C or SIGTERM)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup

from asyncrl.config import AsyncRLConfig, save_config
from asyncrl.config.ray_launch import RayRoleConfig
from asyncrl.exit_codes import CANNOT_START
from launch.ray_cluster.actor import RoleActor, read_keys
from launch.ray_cluster.placement import actor_options, release, reserve
from launch.ray_cluster.roles import RoleSpec, RunArgs, buffer_dir, buffer_role, learner_role, rollout_role
from asyncrl.restarts import GiveUp, QuickDeaths
from asyncrl.stop_signal import StopSignal

log = logging.getLogger("asyncrl.launch")

CURVE_SUBDIR = "curve"  # keys generated for a run without buffer.curve_dir, in its run directory
_CALL_SLICE_S = 1.0  # longest single wait on the cluster, so that Ctrl-C is seen promptly
_STOP_MARGIN_S = 5.0  # beyond ray.stop_timeout_s for the actors to answer a stop


class LaunchError(RuntimeError):
    """The run cannot go on: a role failed where it is not restarted, or the cluster refused it."""

    exit_code = 1  # of `asyncrl launch`


class RoleCannotStart(LaunchError):
    """A role cannot start, or run, from this config or install: a restart would fail alike."""

    exit_code = CANNOT_START


class Stopped(Exception):
    """Ctrl-C or SIGTERM arrived while the launcher waited."""


@dataclass
class Outcome:
    code: int | None  # the role's exit code; None when its actor is gone (killed, node lost)
    reason: str  # for the log: "exited with code 1", "actor died: ..."


@dataclass
class RoleHandle:
    name: str  # buffer, learner-0, rollout-1 ...
    group: PlacementGroup
    bundle: int  # its bundle in the group; a restart takes the same one, hence the same node
    resources: RayRoleConfig
    spec: RoleSpec | None = None  # what its actor runs, once the addresses it needs are known
    actor: Any = None
    deaths: QuickDeaths | None = None  # deaths in a row soon after a start (roles that are restarted)
    restarts: int = 0  # restarts so far, which name its actors apart
    started_at: float = 0.0  # monotonic time its role last started
    restart_at: float | None = None  # monotonic time of the pending restart, while it is dead


class Launch:
    def __init__(self, config: AsyncRLConfig, run: RunArgs, curve_keys: dict[str, bytes]) -> None:
        self.config, self.run, self.curve_keys = config, run, curve_keys
        self.settings = config.ray
        self.stop = StopSignal()
        self.groups: list[PlacementGroup] = []
        self.buffer: RoleHandle | None = None
        self.learners: list[RoleHandle] = []
        self.servers: list[RoleHandle] = []

    def run_to_end(self) -> int:
        """0 when the learner finished, 130 when stopped; LaunchError when the run failed."""
        try:
            buffer_address = self.start_buffer() if not self.config.buffer.address else self.config.buffer.address
            sync_address = self.start_learner(buffer_address)
            self.start_servers(buffer_address, sync_address)
            log.info("all roles started: buffer %s, weight sync %s", buffer_address, sync_address)
            return self.supervise()
        except Stopped:
            log.warning("stopping on SIGINT/SIGTERM")
            return 130
        finally:
            self.teardown()

    # -- starting --------------------------------------------------------------------------------

    def start_buffer(self) -> str:
        group = self.reserve("buffer", self.settings.buffer, 1, "PACK")
        self.buffer = RoleHandle("buffer", group, 0, self.settings.buffer)
        self.spawn(self.buffer)
        host = self.call(self.buffer.actor.where.remote())["ip"]
        directory = buffer_dir(self.config, self.run.run_dir)
        self.buffer.spec = buffer_role(self.run, directory, host, self.config.buffer.port)
        address = self.start(self.buffer, wait_ready=True)
        port = int(address.rsplit(":", 1)[1])
        self.buffer.spec = buffer_role(self.run, directory, host, port)  # a restart binds the same address
        return address

    def start_learner(self, buffer_address: str) -> str:
        """Every rank, in one placement group; returns rank 0's weight-sync address."""
        size = self.config.learner.nproc
        group = self.reserve("learner", self.settings.learner, size, self.settings.learner_strategy)
        self.learners = [RoleHandle(f"learner-{rank}", group, rank, self.settings.learner)
                         for rank in range(size)]
        for handle in self.learners:
            self.spawn(handle)
        hosts = [self.call(handle.actor.where.remote())["ip"] for handle in self.learners]
        master = (hosts[0], self.call(self.learners[0].actor.free_port.remote()))
        for rank, handle in enumerate(self.learners):  # all of them: rank 0 serves only once the world is complete
            handle.spec = learner_role(self.run, self.config, rank, master, buffer_address, hosts[rank])
            self.start(handle)
        return json.loads(self.wait_ready(self.learners[0]))["sync"]

    def start_servers(self, buffer_address: str, sync_address: str) -> None:
        count = self.config.rollout.num_servers
        group = self.reserve("rollout", self.settings.rollout, count, self.settings.rollout_strategy)
        for index in range(count):
            handle = RoleHandle(f"rollout-{index}", group, index, self.settings.rollout,
                                rollout_role(self.run, index, buffer_address, sync_address))
            self.servers.append(handle)
            self.spawn(handle)
            self.start(handle)

    def reserve(self, name: str, role: RayRoleConfig, count: int, strategy: str) -> PlacementGroup:
        group = reserve(f"{self.run.run_dir.name}/{name}", role, count, strategy, self.settings.placement_timeout_s,
                        lambda: self.stop.requested)
        self.groups.append(group)
        return group

    def spawn(self, handle: RoleHandle) -> None:
        """A new actor in the handle's bundle (named <run>/<role>, with .N after the Nth restart)."""
        suffix = f".{handle.restarts}" if handle.restarts else ""
        options = actor_options(handle.group, handle.bundle, handle.resources)
        handle.actor = RoleActor.options(name=f"{self.run.run_dir.name}/{handle.name}{suffix}",
                                         namespace=self.settings.namespace, **options).remote(
            handle.name, os.getcwd(), self.curve_keys, self.settings.stop_timeout_s)

    def start(self, handle: RoleHandle, wait_ready: bool = False) -> str:
        """Start the handle's role in its actor; with `wait_ready`, the ready file's text once it appears."""
        spec = handle.spec
        handle.started_at = time.monotonic()
        self.call(handle.actor.start.remote(spec.module, spec.args, spec.env, spec.log_path(self.run.run_dir),
                                            spec.ready_file))
        where = self.call(handle.actor.where.remote())
        log.info("%s started on node %s (%s), pid %s, output in %s", spec.name, where["ip"], where["node_id"][:12],
                 where["pid"], spec.log_path(self.run.run_dir))
        return self.wait_ready(handle) if wait_ready else ""

    def wait_ready(self, handle: RoleHandle) -> str:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while True:
            outcome = self.outcome(handle)
            if outcome is not None:
                raise LaunchError(f"{handle.name} {outcome.reason} before serving "
                                  f"(see {handle.spec.log_path(self.run.run_dir)})")
            text = self.call(handle.actor.read_file.remote(handle.spec.ready_file))
            if text:
                return text
            if time.monotonic() > deadline:
                raise LaunchError(f"{handle.name} wrote no {handle.spec.ready_file} within "
                                  f"ray.ready_timeout_s={self.settings.ready_timeout_s:.0f}s")
            self.sleep(self.settings.poll_s)

    # -- watching --------------------------------------------------------------------------------

    def supervise(self) -> int:
        while not self.stop.requested:
            outcomes = [self.outcome(handle) for handle in self.learners]
            for handle, outcome in zip(self.learners, outcomes):
                if outcome is not None and outcome.code != 0:
                    raise LaunchError(f"{handle.name} {outcome.reason} (see {handle.spec.log_path(self.run.run_dir)}); "
                                      "learner ranks are not restarted: run the same command again to resume "
                                      "from the newest checkpoint (learner.resume=auto)")
            if all(outcome is not None for outcome in outcomes):
                log.info("the learner finished")
                return 0
            for handle in ([self.buffer] if self.buffer else []) + self.servers:
                self.keep_alive(handle)
            self.sleep(self.settings.poll_s)
        raise Stopped()

    def keep_alive(self, handle: RoleHandle) -> None:
        """Notice a dead role, schedule its restart with exponential back-off, restart it when due."""
        if handle.restart_at is None:
            outcome = self.outcome(handle)
            if outcome is None or outcome.code == 0:  # running, or done: a server leaves once the learner ends the job
                return
            if outcome.code == CANNOT_START:
                raise RoleCannotStart(f"{handle.name} cannot start from this config or install (not restarted): see "
                                      f"{handle.spec.log_path(self.run.run_dir)}")
            handle.deaths = handle.deaths or QuickDeaths.of(self.config.rollout, self.settings.max_restarts)
            give_up = GiveUp(handle.name, "ray.max_restarts", handle.spec.log_path(self.run.run_dir), RoleCannotStart,
                             LaunchError)
            delay = handle.deaths.next_restart(time.monotonic() - handle.started_at, self.last_error(handle, outcome),
                                               outcome.reason, give_up)
            log.warning("%s %s; restart %d in %.1fs (%s)", handle.name, outcome.reason, handle.restarts + 1, delay,
                        handle.deaths.describe())
            self.discard(handle.actor)
            handle.restart_at = time.monotonic() + delay
        elif time.monotonic() >= handle.restart_at:
            handle.restarts += 1
            handle.restart_at = None
            self.spawn(handle)
            self.start(handle, wait_ready=bool(handle.spec.ready_file))

    def last_error(self, handle: RoleHandle, outcome: Outcome) -> str | None:
        """The error the handle's role recorded as it died (None: it records none, or its actor is gone with it)."""
        if not handle.spec.error_file or outcome.code is None:
            return None
        text = self.call(handle.actor.read_file.remote(handle.spec.error_file))  # on the role's node
        return (text or "").strip() or None

    def outcome(self, handle: RoleHandle) -> Outcome | None:
        """None while the role runs; how it ended otherwise."""
        try:
            code = self.call(handle.actor.poll.remote())
        except RayActorError as error:
            return Outcome(None, f"actor died ({str(error).splitlines()[0]})")
        return None if code is None else Outcome(code, f"exited with code {code}")

    # -- stopping --------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Servers and learner ranks first (they use the buffer), then the buffer; then the reservations."""
        for batch in (self.servers + self.learners, [self.buffer] if self.buffer else []):
            actors = [handle.actor for handle in batch if handle.actor is not None]
            stops = [actor.stop.remote() for actor in actors]
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=self.settings.stop_timeout_s + _STOP_MARGIN_S)
            for actor in actors:
                ray.kill(actor)
        for group in self.groups:
            release(group)
        log.info("every role stopped")

    def discard(self, actor: Any) -> None:
        try:
            ray.get(actor.stop.remote(), timeout=self.settings.stop_timeout_s + _STOP_MARGIN_S)
        except (RayActorError, GetTimeoutError):
            pass
        ray.kill(actor)

    # -- waiting ---------------------------------------------------------------------------------

    def call(self, ref: Any) -> Any:
        """ray.get in short slices, so that Ctrl-C interrupts a wait on a slow or stuck actor."""
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while not ray.wait([ref], timeout=_CALL_SLICE_S)[0]:
            if self.stop.requested:
                raise Stopped()
            if time.monotonic() > deadline:
                raise LaunchError(f"no answer from an actor within ray.ready_timeout_s={self.settings.ready_timeout_s:.0f}s")
        return ray.get(ref)

    def sleep(self, seconds: float) -> None:
        if self.stop.requested:
            raise Stopped()
        time.sleep(seconds)


def launch(config: AsyncRLConfig, config_path: str | None, overrides: list[str], run_dir: Path) -> int:
    """Run the job on the Ray cluster at ray.address; the exit code of `asyncrl launch`."""
    save_config(config, run_dir)
    keys = curve_keys(config, run_dir)
    connect(config)
    try:
        return Launch(config, RunArgs(config_path, list(overrides), run_dir), keys).run_to_end()
    finally:
        ray.shutdown()


def connect(config: AsyncRLConfig) -> None:
    try:
        ray.init(address=config.ray.address, namespace=config.ray.namespace, log_to_driver=True)
    except ConnectionError as error:
        raise LaunchError(f"no Ray cluster at ray.address={config.ray.address!r} ({error}); start one with "
                          "`ray start --head` (docs/ray.md)") from error
    log.info("Ray cluster: %s", {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")})


def curve_keys(config: AsyncRLConfig, run_dir: Path) -> dict[str, bytes]:
    """The CURVE keys every role gets: buffer.curve_dir's, or a pair generated for this run (the buffer and
    the learner's weight-sync control socket bind their nodes' addresses, reachable from other nodes). An
    external buffer without keys is refused: its clients could not use generated ones, and the control
    socket must not bind a node's address without them."""
    if config.buffer.curve_dir:
        return read_keys(config.buffer.curve_dir)
    if config.buffer.address:
        raise LaunchError("buffer.curve_dir: the learner's weight-sync control socket binds its node's address, "
                          "which needs CURVE keys; with buffer.address set, run that buffer with keys from "
                          "`asyncrl keygen` and set buffer.curve_dir to the same directory")
    from asyncrl.transport.sockets import SERVER_CERT, generate_curve_keys

    directory = run_dir / CURVE_SUBDIR
    if not (directory / f"{SERVER_CERT}.key").is_file():
        generate_curve_keys(directory)
    return read_keys(directory)
