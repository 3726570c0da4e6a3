"""The `ray` section: how `asyncrl launch` places the roles on a Ray cluster (docs/ray.md).

Each buffer, learner rank and rollout server runs in one Ray actor that reserves `num_cpus`, `num_gpus`
and `resources` through a placement group; custom resources pin a role to the nodes started with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.config.fields import bounded, one_of

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement group strategies


@dataclass
class RayRoleConfig:
    num_cpus: float = bounded(1.0, 0.0)  # logical CPUs Ray reserves for each actor of this role
    num_gpus: float = bounded(0.0, 0.0)  # GPUs per actor (its process sees only these); 0 = a CPU-only role
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per actor, e.g. {gpu_node: 1}


@dataclass
class RayConfig:
    address: str = "auto"  # cluster to join: auto (the one `ray start` runs on this node), host:port or ray://host:port
    namespace: str = "asyncrl"  # Ray namespace of the run's named actors (<run.name>/<role>)
    buffer: RayRoleConfig = field(default_factory=RayRoleConfig)  # the buffer's actor
    learner: RayRoleConfig = field(default_factory=RayRoleConfig)  # each learner rank's actor (learner.nproc of them)
    rollout: RayRoleConfig = field(default_factory=RayRoleConfig)  # each rollout server's actor (rollout.num_servers)
    learner_strategy: str = one_of("PACK", *STRATEGIES[1:])  # placement of the learner ranks' bundles
    rollout_strategy: str = one_of("SPREAD", "PACK", *STRATEGIES[2:])  # placement of the rollout servers' bundles
    placement_timeout_s: float = bounded(120.0, 1.0)  # longest wait for the cluster to grant a role's resources
    ready_timeout_s: float = bounded(600.0, 1.0)  # longest wait for the buffer / learner rank 0 to report its address
    max_restarts: int = bounded(10, 0)  # restarts in a row of a rollout server or the buffer dying within rollout.healthy_after_s of its start; its next such death fails the run
    poll_s: float = bounded(1.0, 0.05)  # how often the driver checks every role
    stop_timeout_s: float = bounded(30.0, 0.1)  # grace after SIGTERM before a role's processes are killed

    def cross_checks(self, tensor_parallel_size: int) -> list[tuple[str, str]]:
        if self.rollout.num_gpus and self.rollout.num_gpus != tensor_parallel_size:
            return [("ray.rollout.num_gpus", f"must be 0 (CPU) or rollout.engine.tensor_parallel_size={tensor_parallel_size}")]
        return []
