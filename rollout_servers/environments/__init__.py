"""The rollout servers' side of multi-turn episodes: the built-in environments, the registry that picks an
environment by data source, and the guards that put deadlines on every environment call."""

from rollout_servers.environments.guarded import ENV_ERROR, ENV_TIMEOUT, EnvironmentFailure, GuardedEnvironment
from rollout_servers.environments.registry import BUILTIN_ENVIRONMENTS, EnvironmentConfigError, EnvironmentRegistry

__all__ = ["BUILTIN_ENVIRONMENTS", "ENV_ERROR", "ENV_TIMEOUT", "EnvironmentConfigError", "EnvironmentFailure",
           "EnvironmentRegistry", "GuardedEnvironment"]
