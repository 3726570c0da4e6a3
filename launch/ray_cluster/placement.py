"""Placement groups: one bundle per actor of a role, sized from the `ray` config section."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl.config.ray_launch import RayRoleConfig


class ResourcesNotGranted(RuntimeError):
    """The cluster did not grant a role's resources in time."""


def bundle(role: RayRoleConfig) -> dict[str, float]:
    """One actor's reservation; zero amounts are left out (Ray refuses them)."""
    wanted = {"CPU": role.num_cpus, "GPU": role.num_gpus, **role.resources}
    return {name: amount for name, amount in wanted.items() if amount}


def reserve(name: str, role: RayRoleConfig, count: int, strategy: str, timeout_s: float,
            should_stop: Any) -> PlacementGroup:
    """A placement group of `count` bundles, once the cluster has granted it (ResourcesNotGranted if not)."""
    group = placement_group([bundle(role)] * count, strategy=strategy, name=name)
    deadline = time.monotonic() + timeout_s
    ready = group.ready()
    while not ray.wait([ready], timeout=1.0)[0]:
        if should_stop() or time.monotonic() > deadline:
            remove_placement_group(group)
            raise ResourcesNotGranted(f"{name}: the cluster did not grant {count} x {bundle(role)} ({strategy}) within "
                                 f"{timeout_s:.0f}s; available: {ray.available_resources()}")
    return group


def actor_options(group: PlacementGroup, index: int, role: RayRoleConfig) -> dict[str, Any]:
    """Options that put an actor into bundle `index` of `group` with that bundle's resources."""
    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)
    return {"num_cpus": role.num_cpus, "num_gpus": role.num_gpus, "resources": dict(role.resources),
            "scheduling_strategy": strategy}


def release(group: PlacementGroup) -> None:
    remove_placement_group(group)
