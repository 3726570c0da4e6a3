"""Which environment runs the episodes of a data source: a built-in by name, or a user class by
`path/to/file.py:Class` (or `package.module:Class`), as configured in `environment.by_source`.

Every name is resolved when the server starts (`EnvironmentRegistry.from_config`), so a typo or a broken
file stops it at once with the config key named, not at the first prompt of that source.
"""

from __future__ import annotations

import inspect
from typing import Callable, Mapping

from asyncrl.environments.base import Environment
from rollout_servers.environments.calculator import CalculatorEnvironment
from rollout_servers.environments.guarded import ENV_ERROR, EnvironmentFailure, GuardedEnvironment
from rollout_servers.environments.guess_number import GuessNumberEnvironment
from asyncrl.config.fields import SPEC_SEPARATOR
from asyncrl.user_code import UserCodeError, describe_exception, load_object

BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {
    "calculator": CalculatorEnvironment,
    "guess_number": GuessNumberEnvironment,
}
CONFIG_KEY = "environment.by_source"
_REQUIRED_COROUTINES = ("reset", "step")


class EnvironmentConfigError(ValueError):
    """An environment named in the config cannot be used; the message names the config key."""


def resolve_environment(spec: str, key: str = CONFIG_KEY) -> Callable[[], Environment]:
    """The class (or factory) `spec` names, checked to provide the protocol's coroutines."""
    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec]
    if SPEC_SEPARATOR not in spec:
        raise EnvironmentConfigError(f"{key}: '{spec}' is neither a built-in environment "
                                     f"{sorted(BUILTIN_ENVIRONMENTS)} nor of the form path/to/file.py:Class")
    try:
        factory = load_object(spec, "asyncrl_env")
    except UserCodeError as error:
        raise EnvironmentConfigError(f"{key}: {error}") from error
    missing = [name for name in _REQUIRED_COROUTINES if not inspect.iscoroutinefunction(getattr(factory, name, None))]
    if not callable(factory) or missing:
        raise EnvironmentConfigError(f"{key}: '{spec}' is not an environment class: it needs async methods "
                                     f"{list(_REQUIRED_COROUTINES)} (missing or not async: {missing})")
    return factory


class EnvironmentRegistry:
    """Data source → environment factory; a source not listed is single-turn (scored by the reward scorer)."""

    def __init__(self, by_source: Mapping[str, Callable[[], Environment]], names: Mapping[str, str]) -> None:
        self._by_source = dict(by_source)
        self._names = dict(names)

    @classmethod
    def from_config(cls, by_source: Mapping[str, str]) -> EnvironmentRegistry:
        """Resolve every configured environment now (errors name `environment.by_source.<data_source>`)."""
        factories = {source: resolve_environment(spec, f"{CONFIG_KEY}.{source}") for source, spec in by_source.items()}
        return cls(factories, by_source)

    def handles(self, data_source: str) -> bool:
        """True when episodes of this data source run in an environment (multi-turn)."""
        return data_source in self._by_source

    def create(self, data_source: str) -> GuardedEnvironment:
        """A fresh environment for one episode of `data_source`, behind its deadline guard; a constructor
        that raises is that episode's `EnvironmentFailure`."""
        name = self._names[data_source]
        try:
            environment = self._by_source[data_source]()
        except Exception as error:  # user code: the episode fails, the server carries on
            raise EnvironmentFailure(ENV_ERROR, f"creating environment '{name}' raised {describe_exception(error)}") from error
        return GuardedEnvironment(environment, name)
