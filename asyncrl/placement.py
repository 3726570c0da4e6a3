"""Which GPUs each role of a job on this machine uses: the learner's ranks and every rollout server
(`rollout.engine.tensor_parallel_size` GPUs each), from `learner.gpus` / `rollout.gpus` or, where they are
empty and `asyncrl run` starts the whole job, split automatically among the visible GPUs. Pure functions of
the config and the visible GPUs; the commands print the plan, refuse an impossible one before anything
starts, and pin each process to its GPUs through CUDA_VISIBLE_DEVICES. `asyncrl run` hands its plan to the
two commands it starts as explicit lists; a command started alone without lists uses the GPUs it sees.

Automatic split: servers take GPUs of their own first, `num_servers` × tensor-parallel of them, the learner's ranks
the next `learner.nproc`, and the servers that GPUs of their own cannot hold run beside the learner, on its first
rank's GPU (`rollout.placement`: auto shares only those; shared puts at least one there; apart none). One visible
GPU is thus shared by the learner and every server (colocated); two GPUs and two servers give each GPU a server, the
second also running the learner (a mixed plan).

Each server receives the weights on the backend that works where it is (`server_places`): a server beside the
learner by CUDA IPC (`weight_sync.backend: auto` means ipc there), a server on GPUs of its own by NCCL. A backend that
does not work where the plan puts a server is refused before anything starts: `nccl` beside the learner (NCCL refuses
two ranks on one GPU), `ipc` apart (`asyncrl.weight_transfer.backends`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from asyncrl.config import AsyncRLConfig, ConfigError
from asyncrl.gpu_ids import listed_server_gpus, visible_gpus
from asyncrl.weight_transfer.kinds import IPC_KIND, alternatives, named_kind, placed_kind

COLOCATED_SERVERS_SHARE = 0.4  # most of a shared GPU's memory budget the servers take together; the learner gets the rest
APART, SHARED = "apart", "shared"  # rollout.placement: no server beside the learner; at least one


class PlacementError(ConfigError):
    """The GPUs asked for cannot be given; the message names the keys."""


@dataclass(frozen=True)
class Plan:
    learner: tuple[int, ...]  # a GPU per learner rank (physical ids)
    servers: tuple[tuple[int, ...], ...]  # each rollout server's GPUs

    @property
    def colocated(self) -> bool:
        """The learner shares a GPU with a server."""
        return self.sharing > 0

    @property
    def sharing(self) -> int:
        """How many servers run on the learner's GPUs."""
        return sum(self.shares(index) for index in range(len(self.servers)))

    def shares(self, index: int) -> bool:
        """Server `index` runs on (some of) the learner's GPUs."""
        return bool(set(self.servers[index]) & set(self.learner))

    def beside_learner(self, index: int) -> bool:
        """Server `index` runs on the first learner rank's GPU alone, where CUDA IPC reaches it."""
        return self.servers[index] == self.learner[:1]

    @property
    def server_gpus(self) -> list[int]:
        """Every server's GPUs, server after server (as `rollout.gpus` lists them)."""
        return [gpu for server in self.servers for gpu in server]

    def unused(self, visible: list[int]) -> list[int]:
        used = set(self.learner) | set(self.server_gpus)
        return [gpu for gpu in visible if gpu not in used]

    def describe(self) -> str:
        servers = ", ".join(f"server-{i} → {_ids(gpus)}" + (" (with the learner)" if self.shares(i) else "")
                            for i, gpus in enumerate(self.servers))
        kind = " (colocated)" if self.sharing == len(self.servers) else " (mixed)" if self.colocated else ""
        return f"GPU plan: learner → {_ids(self.learner)}; {servers}{kind}"


@dataclass(frozen=True)
class ServerPlace:
    """Where one server runs and what follows from it."""

    gpus: tuple[int, ...]  # its GPUs (physical ids)
    backend: str  # how it receives the weights: ipc beside the learner, else gloo or nccl
    gpu_memory_utilization: float  # its engine's share of each GPU's memory budget (lowered beside the learner)
    with_learner: bool  # it runs on the learner's GPU

    def describe(self, index: int) -> str:
        where = "beside the learner" if self.with_learner else "on GPUs of its own"
        return (f"server-{index} {where}: weights by {self.backend}, "
                f"gpu_memory_utilization {self.gpu_memory_utilization:g}")

    def apply(self, config: AsyncRLConfig) -> None:
        """Make `config` (a server process's own) say what this place decided for it."""
        config.rollout.weight_sync.backend = self.backend
        config.rollout.engine.gpu_memory_utilization = self.gpu_memory_utilization


def plan_placement(config: AsyncRLConfig, visible: list[int], automatic: bool = True) -> Plan | None:
    """The plan for `visible` GPUs: None on a machine without any, or without lists when not `automatic`;
    PlacementError for an impossible one."""
    learner, rollout = config.learner, config.rollout
    tp = rollout.engine.tensor_parallel_size
    if not visible:
        if learner.gpus or rollout.gpus:
            key = "learner.gpus" if learner.gpus else "rollout.gpus"
            raise PlacementError(f"{key}: no GPU is visible on this machine")
        return None
    if not (automatic or learner.gpus or rollout.gpus):
        return None
    wanted_learner = _checked(learner.gpus, learner.nproc, "learner.gpus", "learner.nproc", visible, 1, may_share=False)
    wanted_rollout = _checked(rollout.gpus, rollout.num_servers * tp, "rollout.gpus",
                              "rollout.num_servers × rollout.engine.tensor_parallel_size", visible, tp, may_share=True)
    if wanted_rollout:
        learner_gpus = wanted_learner or _take(visible, exclude=wanted_rollout, count=learner.nproc,
                                               role="learner ranks", need_keys="learner.nproc")
        servers = tuple(tuple(wanted_rollout[i * tp:(i + 1) * tp]) for i in range(rollout.num_servers))
    else:
        learner_gpus, servers = _split(config, visible, wanted_learner)
    plan = Plan(learner=tuple(learner_gpus), servers=servers)
    _check_sharing(plan, _placement_mode(config))
    return plan


def _placement_mode(config: AsyncRLConfig) -> str:
    """`rollout.placement`, but shared for colocated synchronous ranks (`learner.mode=synchronous` with
    `learner.nproc` > 1): every rank runs its engine beside it, so the plan's server is on the learner's GPUs."""
    if config.learner.mode == "synchronous" and config.learner.nproc > 1:
        return SHARED
    return config.rollout.placement


def _split(config: AsyncRLConfig, visible: list[int], wanted_learner: list[int]) -> tuple[list[int], tuple]:
    """The automatic split where `rollout.gpus` is empty: the servers that fit on GPUs of their own take them first,
    the learner the next ones (or `wanted_learner`), and the rest of the servers go beside it."""
    learner, rollout = config.learner, config.rollout
    tp, count = rollout.engine.tensor_parallel_size, rollout.num_servers
    if not wanted_learner and learner.nproc > len(visible):
        raise PlacementError(f"learner.nproc={learner.nproc}: {len(visible)} GPUs are visible, a learner rank needs "
                             "one of its own")
    room = (len(visible) - len(wanted_learner or range(learner.nproc))) // tp  # servers GPUs of their own could hold
    beside = _servers_beside_learner(_placement_mode(config), count, room)
    if beside and tp > 1:
        raise PlacementError(f"rollout.engine.tensor_parallel_size={tp}: {beside} server(s) would run beside the "
                             f"learner, and such a server runs on the learner's one GPU (tensor_parallel_size 1); "
                             f"with rollout.placement={rollout.placement} lower rollout.num_servers or give it GPUs")
    if count - beside > room:
        raise PlacementError(f"learner.nproc={learner.nproc} + rollout.num_servers={count} × "
                             f"rollout.engine.tensor_parallel_size={tp} need {learner.nproc + count * tp} GPUs and "
                             f"{len(visible)} are visible: lower them, set rollout.placement=shared or auto (servers "
                             "beside the learner), or list the same GPUs in learner.gpus and rollout.gpus")
    apart_gpus = _take(visible, exclude=wanted_learner, count=(count - beside) * tp, role="rollout servers",
                       need_keys="rollout.num_servers, rollout.engine.tensor_parallel_size")
    learner_gpus = wanted_learner or _take(visible, exclude=apart_gpus, count=learner.nproc, role="learner ranks",
                                           need_keys="learner.nproc")
    apart = [tuple(apart_gpus[i * tp:(i + 1) * tp]) for i in range(count - beside)]
    return learner_gpus, tuple(apart + [(learner_gpus[0],)] * beside)


def _servers_beside_learner(mode: str, servers: int, room: int) -> int:
    """How many of `servers` run beside the learner when GPUs of their own could hold `room` of them."""
    if mode == APART:
        return 0
    overflow = max(servers - room, 0)
    return max(overflow, 1) if mode == SHARED else overflow


def _check_sharing(plan: Plan, mode: str) -> None:
    """A server shares all of its GPUs with the learner or none (memory is split per GPU), and the plan keeps
    `rollout.placement`."""
    for index, gpus in enumerate(plan.servers):
        if plan.shares(index) and not set(gpus) <= set(plan.learner):
            raise PlacementError(f"rollout.gpus: server-{index} on {_ids(gpus)} shares some of learner.gpus "
                                 f"{_ids(plan.learner)} but not all its GPUs: give it the learner's GPUs or none of them")
    if mode == APART and plan.colocated:
        raise PlacementError(f"rollout.placement=apart: {plan.describe()} puts a server on the learner's GPU; "
                             "list GPUs apart in learner.gpus and rollout.gpus, or set rollout.placement=auto")
    if mode == SHARED and not plan.colocated:
        raise PlacementError(f"rollout.placement=shared: {plan.describe()} puts no server on the learner's GPU; "
                             "list one of learner.gpus in rollout.gpus, or set rollout.placement=auto")


def server_places(config: AsyncRLConfig, plan: Plan) -> tuple[ServerPlace, ...]:
    """Each server's place in `plan`: its GPUs, the backend it receives the weights on (PlacementError, naming the
    server and the key, where `rollout.weight_sync.backend` does not work there) and its engine's memory share."""
    share = share_beside_learner(config, plan.sharing)
    return tuple(ServerPlace(gpus, _server_backend(config.rollout.weight_sync.backend, plan, index),
                             share if plan.shares(index) else config.rollout.engine.gpu_memory_utilization,
                             plan.shares(index))
                 for index, gpus in enumerate(plan.servers))


def _server_backend(name: str, plan: Plan, index: int) -> str:
    """The backend server `index` receives on: `name`, or for `auto` ipc beside the learner and nccl apart (a plan
    exists only where GPUs are visible)."""
    shares = plan.shares(index)
    where = (f"server-{index} on {_ids(plan.servers[index])} " +
             ("shares the learner's GPU" if shares else "has GPUs of its own") + f" ({plan.describe()})")
    _refuse_where_it_fails(name, shares, where, [plan.shares(other) for other in range(len(plan.servers))])
    chosen = placed_kind(name, shares).name
    if chosen == IPC_KIND.name and not plan.beside_learner(index):
        raise PlacementError(f"rollout.weight_sync.backend={name}: {where}, and CUDA IPC reaches a server only on the "
                             f"first learner rank's GPU {_ids(plan.learner[:1])} alone; use gloo, or move the server")
    return chosen


def weight_sync_backend(config: AsyncRLConfig, plan: Plan | None) -> str:
    """The job's weight-sync backend, what a server not told its own receives on: `auto` is ipc when every server
    shares the learner's GPU; a backend that does not work where the plan puts a server (nccl on a shared GPU, ipc
    apart) is refused (`server_places` gives each server its own)."""
    name = config.rollout.weight_sync.backend
    if plan is None:
        return name
    server_places(config, plan)  # refuses a backend that some server cannot receive on
    if plan.sharing < len(plan.servers):
        return name  # `auto` stays: each process decides it where it runs (`backends.weight_backend`)
    return placed_kind(name, shared_gpu=True).name


def place_local_job(config: AsyncRLConfig, log, automatic: bool = False) -> Plan | None:
    """The plan of a job on this machine (split `automatic`ally where the lists are empty), logged with each server's
    place, and `rollout.weight_sync.backend` set to what it allows (changes `config` in place; `server_places` says
    what each server receives on); PlacementError before anything starts when it cannot be given."""
    visible = visible_gpus()
    if not visible:
        _check_backend_without_gpu(config.rollout.weight_sync.backend)
    plan = plan_placement(config, visible, automatic)
    if plan is not None:
        log.info("%s", plan.describe())
        unused = plan.unused(visible)
        if unused:
            log.info("GPUs %s are visible and unused (rollout.num_servers, learner.nproc)", _ids(unused))
        for index, place in enumerate(server_places(config, plan)):
            log.info("%s", place.describe(index))
        leave_room_for_the_learner(config, plan, log)
        config.rollout.weight_sync.backend = weight_sync_backend(config, plan)
    return plan


def _refuse_where_it_fails(name: str, shared_gpu: bool, where: str, elsewhere: Collection[bool] = ()) -> None:
    """PlacementError when backend `name` does not work where a server does (`shared_gpu`) or does not share the
    learner's GPU; `where` says how the roles are placed, `elsewhere` where the plan's other servers are (the advice
    fits them all). `auto` always works (placement decides it)."""
    kind = named_kind(name)
    if kind is not None and not kind.works(shared_gpu):
        raise PlacementError(f"rollout.weight_sync.backend={name}: {where}, and {kind.limit}; "
                             f"use {alternatives(shared_gpu, elsewhere)}")


def _check_backend_without_gpu(name: str) -> None:
    """A backend that carries the weights through GPU memory is refused on a machine without a visible GPU."""
    kind = named_kind(name)
    if kind is not None and kind.device_type == "cuda":
        raise PlacementError(f"rollout.weight_sync.backend={name}: {kind.title} needs a GPU and none is visible; "
                             f"use {alternatives(None)}")


def share_beside_learner(config: AsyncRLConfig, servers: int) -> float:
    """The `gpu_memory_utilization` of each of `servers` servers on the learner's GPU: together they take at most
    COLOCATED_SERVERS_SHARE of its memory budget (`run.gpu_memory_gib`, `asyncrl.memory_plan`), so a larger
    `rollout.engine.gpu_memory_utilization` is lowered to fit. Servers on GPUs of their own keep the configured share."""
    wanted = config.rollout.engine.gpu_memory_utilization
    if not servers or wanted * servers <= COLOCATED_SERVERS_SHARE:
        return wanted
    return round(COLOCATED_SERVERS_SHARE / servers, 3)


def leave_room_for_the_learner(config: AsyncRLConfig, plan: Plan, log) -> None:
    """Warn when the servers on the learner's GPU get less than `rollout.engine.gpu_memory_utilization`
    (`share_beside_learner`); the learner's part of that GPU leaves their share free, started or not
    (`servers_on_learner_gpu`)."""
    engine = config.rollout.engine
    beside = plan.sharing
    lowered = share_beside_learner(config, beside)
    if lowered < engine.gpu_memory_utilization:
        log.warning("rollout.engine.gpu_memory_utilization=%g × %d server(s) on the learner's GPU would leave the "
                    "learner too little of it: using %g for each of them (set it to at most %g to choose; servers on "
                    "GPUs of their own keep %g)", engine.gpu_memory_utilization, beside, lowered, lowered,
                    engine.gpu_memory_utilization)


def servers_on_learner_gpu(config: AsyncRLConfig) -> tuple[int, float]:
    """How many rollout servers run on the learner's GPU and each one's share of its memory budget (none when the
    roles have GPUs of their own), from the lists `asyncrl run` hands the learner: what the learner leaves them,
    also before they have started."""
    plan = listed_plan(config)
    return plan.sharing, share_beside_learner(config, plan.sharing)


def listed_plan(config: AsyncRLConfig) -> Plan:
    """The plan `learner.gpus` and `rollout.gpus` name as they are (empty where a list is): what `asyncrl run` hands
    its roles and what a run directory's config.yaml keeps."""
    return Plan(tuple(config.learner.gpus), listed_server_gpus(config))


def check_ray_placement(config: AsyncRLConfig) -> None:
    """`asyncrl launch`: Ray picks each actor's GPUs, by the rule a plan on one machine follows (a learner rank takes
    one GPU, a server `tensor_parallel_size` of them, `ray.rollout.num_gpus` checks that), so GPU ids and shared
    GPUs are refused before anything starts (PlacementError naming the key)."""
    for key, ids in (("learner.gpus", config.learner.gpus), ("rollout.gpus", config.rollout.gpus)):
        if ids:
            raise PlacementError(f"{key}={_ids(ids)}: under asyncrl launch Ray picks each actor's GPUs; leave it empty "
                                 "and set ray.learner.num_gpus / ray.rollout.num_gpus (docs/ray.md)")
    learner_gpus = config.ray.learner.num_gpus
    if learner_gpus not in (0, 1):
        raise PlacementError(f"ray.learner.num_gpus={learner_gpus:g}: a learner rank takes one GPU (1) or none (0, on "
                             "CPU); Ray does not say which actors would share a fraction of one")
    if config.learner.device == "cuda" and not learner_gpus:
        raise PlacementError("learner.device=cuda with ray.learner.num_gpus=0: the learner ranks' actors would see no "
                             "GPU; set ray.learner.num_gpus=1")
    if config.rollout.placement == SHARED:
        raise PlacementError("rollout.placement=shared: under asyncrl launch every actor has GPUs of its own; "
                             "set it to auto or apart")
    _refuse_where_it_fails(config.rollout.weight_sync.backend, shared_gpu=False,
                           where="under asyncrl launch every actor has GPUs of its own")


def as_overrides(plan: Plan) -> list[str]:
    """The plan as the two commands' overrides: explicit lists, which they apply as given."""
    return [f"learner.gpus={_ids(plan.learner)}", f"rollout.gpus={_ids(plan.server_gpus)}"]


def write_lists(config: AsyncRLConfig, plan: Plan) -> None:
    """Make `config` name the plan's GPUs as explicit lists (`as_overrides` in place): what the roles read to know
    which of them share a GPU."""
    config.learner.gpus, config.rollout.gpus = list(plan.learner), plan.server_gpus


def _checked(gpus: list[int], count: int, key: str, count_key: str, visible: list[int], group: int,
             may_share: bool) -> list[int]:
    """`gpus` checked against its count and the visible GPUs. It is cut into groups of `group` ids (a learner
    rank, a tensor-parallel server); a GPU never repeats within a group, and across groups only `may_share`
    (servers may share a GPU; NCCL refuses two learner ranks on one)."""
    if not gpus:
        return []
    if len(gpus) != count:
        raise PlacementError(f"{key}: {len(gpus)} GPUs listed, {count_key} needs {count}")
    groups = [gpus[start:start + group] for start in range(0, len(gpus), group)]
    if any(len(set(ids)) != len(ids) for ids in groups) or (not may_share and len(set(gpus)) != len(gpus)):
        raise PlacementError(f"{key}: {_ids(gpus)} names a GPU twice where it cannot be shared")
    missing = [gpu for gpu in gpus if gpu not in visible]
    if missing:
        raise PlacementError(f"{key}: GPU {_ids(missing)} is not visible (visible: {_ids(visible)})")
    return list(gpus)


def _take(visible: list[int], exclude: list[int], count: int, role: str, need_keys: str) -> list[int]:
    free = [gpu for gpu in visible if gpu not in exclude]
    if len(free) < count:
        raise PlacementError(f"{need_keys}: the {role} need {count} GPUs and {len(free)} of the {len(visible)} visible "
                             f"are left for them; lower them, or list the GPUs in learner.gpus / rollout.gpus")
    return free[:count]


def _ids(gpus) -> str:
    return "[" + ",".join(str(gpu) for gpu in gpus) + "]"
