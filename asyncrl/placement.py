"""Which GPUs each role of a job on this machine uses: the learner's ranks and every rollout server
(`rollout.engine.tensor_parallel_size` GPUs each), from `learner.gpus` / `rollout.gpus` or, where they are
empty and `asyncrl run` starts the whole job, split automatically among the visible GPUs. Pure functions of
the config and the visible GPUs; the commands print the plan, refuse an impossible one before anything
starts, and pin each process to its GPUs through CUDA_VISIBLE_DEVICES. `asyncrl run` hands its plan to the
two commands it starts as explicit lists; a command started alone without lists uses the GPUs it sees.

Automatic split: one visible GPU is shared by the learner and every server (colocated); with more, the
servers take the first `num_servers` × tensor-parallel GPUs and the learner's ranks the next `learner.nproc`.
A colocated plan syncs weights through CUDA IPC (`weight_sync.backend: auto` means ipc there). A backend that does
not work where the plan puts the roles is refused before anything starts: `nccl` on a shared GPU (NCCL refuses two
ranks on one GPU), `ipc` for roles apart (`asyncrl.weight_transfer.backends`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from asyncrl.config import AsyncRLConfig, ConfigError
from asyncrl.weight_transfer.backends import alternatives, named, placed

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
COLOCATED_SERVERS_SHARE = 0.4  # most of a shared GPU's memory the servers take together; the learner gets the rest


class PlacementError(ConfigError):
    """The GPUs asked for cannot be given; the message names the keys."""


@dataclass(frozen=True)
class Plan:
    learner: tuple[int, ...]  # a GPU per learner rank (physical ids)
    servers: tuple[tuple[int, ...], ...]  # each rollout server's GPUs

    @property
    def colocated(self) -> bool:
        """The learner shares a GPU with a server."""
        return bool(set(self.learner) & {gpu for server in self.servers for gpu in server})

    def unused(self, visible: list[int]) -> list[int]:
        used = set(self.learner) | {gpu for server in self.servers for gpu in server}
        return [gpu for gpu in visible if gpu not in used]

    def describe(self) -> str:
        servers = ", ".join(f"server-{i} → {_ids(gpus)}" for i, gpus in enumerate(self.servers))
        shared = " (colocated)" if self.colocated else ""
        return f"GPU plan: learner → {_ids(self.learner)}; {servers}{shared}"


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
    if not wanted_learner and not wanted_rollout:
        if len(visible) == 1:
            return _colocated(visible[0], learner.nproc, rollout.num_servers, tp)
        need = learner.nproc + rollout.num_servers * tp
        if need > len(visible):
            raise PlacementError(f"learner.nproc={learner.nproc} + rollout.num_servers={rollout.num_servers} × "
                                 f"rollout.engine.tensor_parallel_size={tp} need {need} GPUs and {len(visible)} are "
                                 "visible: lower them, or share GPUs by listing the same ones in learner.gpus and rollout.gpus")
    server_gpus = wanted_rollout or _take(visible, exclude=wanted_learner, count=rollout.num_servers * tp,
                                          role="rollout servers", need_keys="rollout.num_servers, rollout.engine.tensor_parallel_size")
    learner_gpus = wanted_learner or _take(visible, exclude=server_gpus, count=learner.nproc, role="learner ranks",
                                           need_keys="learner.nproc")
    shared = set(learner_gpus) & set(server_gpus)
    if shared and set(learner_gpus) != set(server_gpus):
        raise PlacementError(f"learner.gpus {_ids(learner_gpus)} and rollout.gpus {_ids(server_gpus)} share "
                             f"{_ids(sorted(shared))} but not all their GPUs: give them the same list (colocated) or none in common")
    servers = tuple(tuple(server_gpus[i * tp:(i + 1) * tp]) for i in range(rollout.num_servers))
    return Plan(learner=tuple(learner_gpus), servers=servers)


def visible_gpus() -> list[int]:
    """Physical ids of the GPUs this process may use (CUDA_VISIBLE_DEVICES, else every GPU torch counts)."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get(VISIBLE_DEVICES)
    if listed is None:
        return list(range(count))
    ids = [int(part) for part in listed.split(",") if part.strip().isdigit()]
    return ids[:count]


def weight_sync_backend(config: AsyncRLConfig, plan: Plan | None) -> str:
    """The weight-sync backend the plan allows: `auto` is ipc when colocated; a backend that does not work where the
    plan puts the roles (nccl on a shared GPU, ipc apart) is refused."""
    name = config.rollout.weight_sync.backend
    if plan is None:
        return name
    where = ("the learner and a rollout server share a GPU" if plan.colocated
             else "the plan puts the learner and the servers on GPUs of their own")
    _refuse_where_it_fails(name, plan.colocated, f"{where} ({plan.describe()})")
    return placed(name, plan.colocated)


def place_local_job(config: AsyncRLConfig, log, automatic: bool = False) -> Plan | None:
    """The plan of a job on this machine (split `automatic`ally where the lists are empty), logged, with
    `rollout.weight_sync.backend` set to what it allows (changes `config` in place); PlacementError before
    anything starts when it cannot be given."""
    visible = visible_gpus()
    if not visible:
        _check_backend_without_gpu(config.rollout.weight_sync.backend)
    plan = plan_placement(config, visible, automatic)
    if plan is not None:
        log.info("%s", plan.describe())
        unused = plan.unused(visible)
        if unused:
            log.info("GPUs %s are visible and unused (rollout.num_servers, learner.nproc)", _ids(unused))
        config.rollout.weight_sync.backend = weight_sync_backend(config, plan)
        if plan.colocated:
            leave_room_for_the_learner(config, log)
    return plan


def _refuse_where_it_fails(name: str, shared_gpu: bool, where: str) -> None:
    """PlacementError when backend `name` does not work where a server does (`shared_gpu`) or does not share the
    learner's GPU; `where` says how the roles are placed. `auto` always works (placement decides it)."""
    backend = named(name)
    if backend is not None and not backend.works(shared_gpu):
        raise PlacementError(f"rollout.weight_sync.backend={name}: {where}, and {backend.limit}; "
                             f"use {alternatives(shared_gpu)}")


def _check_backend_without_gpu(name: str) -> None:
    """A backend that carries the weights through GPU memory is refused on a machine without a visible GPU."""
    backend = named(name)
    if backend is not None and backend.device_type == "cuda":
        raise PlacementError(f"rollout.weight_sync.backend={name}: {backend.title} needs a GPU and none is visible; "
                             f"use {alternatives(None)}")


def leave_room_for_the_learner(config: AsyncRLConfig, log) -> None:
    """On a shared GPU the servers together take at most COLOCATED_SERVERS_SHARE of its memory (each server's
    `rollout.engine.gpu_memory_utilization` is lowered to fit, with a warning); the learner's
    `micro_batch_tokens: auto` leaves that share free, started or not (`servers_share_of_learner_gpu`)."""
    engine, servers = config.rollout.engine, config.rollout.num_servers
    if engine.gpu_memory_utilization * servers <= COLOCATED_SERVERS_SHARE:
        return
    lowered = round(COLOCATED_SERVERS_SHARE / servers, 3)
    log.warning("rollout.engine.gpu_memory_utilization=%g × %d server(s) would leave the learner too little of the "
                "shared GPU: using %g per server (set it to at most %g to choose)", engine.gpu_memory_utilization,
                servers, lowered, lowered)
    engine.gpu_memory_utilization = lowered


def servers_share_of_learner_gpu(config: AsyncRLConfig) -> float:
    """The share of the learner's GPU memory that rollout servers on that GPU take (0 when the roles have GPUs of
    their own): what a colocated learner must leave free, also before the servers have started."""
    if not set(config.learner.gpus) & set(config.rollout.gpus):
        return 0.0
    return config.rollout.engine.gpu_memory_utilization * config.rollout.num_servers


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
    _refuse_where_it_fails(config.rollout.weight_sync.backend, shared_gpu=False,
                           where="under asyncrl launch every actor has GPUs of its own")


def as_overrides(plan: Plan) -> list[str]:
    """The plan as the two commands' overrides: explicit lists, which they apply as given."""
    servers = [gpu for server in plan.servers for gpu in server]
    return [f"learner.gpus={_ids(plan.learner)}", f"rollout.gpus={_ids(servers)}"]


def pin(gpus: tuple[int, ...] | list[int]) -> None:
    """Make only `gpus` visible to this process and its children (before CUDA is first used)."""
    os.environ[VISIBLE_DEVICES] = ",".join(str(gpu) for gpu in gpus)


def _colocated(gpu: int, nproc: int, servers: int, tp: int) -> Plan:
    if nproc > 1 or tp > 1:
        key = "learner.nproc" if nproc > 1 else "rollout.engine.tensor_parallel_size"
        raise PlacementError(f"{key}: one GPU is visible, and a colocated job runs one learner rank and servers of "
                             "tensor_parallel_size 1 on it")
    return Plan(learner=(gpu,), servers=tuple((gpu,) for _ in range(servers)))


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
