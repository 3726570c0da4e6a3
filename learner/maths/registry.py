"""Name → function registries for the learner's pluggable parts (policy losses, advantage estimators).

A config value is either a registered name or a reference to a user's own function, so a new loss
needs no edit of the learner:
- `path/to/file.py:function` imports the file (relative paths from the working directory);
- `package.module:function` imports an installed or importable module.
Every failure raises `RegistryError` naming the config key, the value, and what was missing.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Callable, Generic, TypeVar

from asyncrl.user_code import UserCodeError, import_location, split_spec

F = TypeVar("F", bound=Callable)

REFERENCE_FORMS = "'path/to/file.py:function' or 'package.module:function'"
USER_MODULE_PREFIX = "asyncrl_user"  # user files run as modules named asyncrl_user_<stem>_<hash of the path>


class RegistryError(ValueError):
    """A name or function reference cannot be resolved. The message names the config key and the value."""


class Registry(Generic[F]):
    """Functions of one kind, keyed by name, plus resolution of `source:function` references."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind  # what the functions are, for messages ("loss")
        self.config_key = config_key  # the config key users set, for messages ("algorithm.loss")
        self._registered: dict[str, F] = {}
        self._resolved_references: dict[str, F] = {}  # imported once per reference

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding a function under `name`; a second, different function for a name is an error."""

        def add(function: F) -> F:
            known = self._registered.get(name)
            if known is not None and known is not function:
                raise RegistryError(f"{self.kind} '{name}' is already registered (by {known.__module__})")
            self._registered[name] = function
            return function

        return add

    def names(self) -> list[str]:
        return sorted(self._registered)

    def get(self, value: str) -> F:
        """The function a config value means: a registered name or a `source:function` reference."""
        if value in self._registered:
            return self._registered[value]
        if ":" not in value:
            registered = ", ".join(self.names())
            raise self._error(value, f"no such {self.kind} (registered: {registered}); or give {REFERENCE_FORMS}")
        if value not in self._resolved_references:
            self._resolved_references[value] = self._resolve_reference(value)
        return self._resolved_references[value]

    def _resolve_reference(self, value: str) -> F:
        try:
            source, function_name = split_spec(value)
        except UserCodeError:
            raise self._error(value, f"expected {REFERENCE_FORMS}") from None
        try:
            module = import_location(source, USER_MODULE_PREFIX)
        except UserCodeError as error:
            raise self._error(value, str(error)) from error
        return self._find_function(value, module, source, function_name)

    def _find_function(self, value: str, module: ModuleType, source: str, function_name: str) -> F:
        if not hasattr(module, function_name):
            defined = ", ".join(_public_functions(module)) or "none"
            raise self._error(value, f"'{source}' defines no '{function_name}' (functions there: {defined})")
        function = getattr(module, function_name)
        if not callable(function):
            raise self._error(value, f"'{function_name}' in '{source}' is a {type(function).__name__}, not a function")
        return function

    def _error(self, value: str, problem: str) -> RegistryError:
        return RegistryError(f"{self.config_key}: {self.kind} '{value}': {problem}")


def _public_functions(module: ModuleType) -> list[str]:
    """Names of the functions the module itself defines (not imported ones), for error messages."""
    return sorted(
        name
        for name, attribute in vars(module).items()
        if inspect.isfunction(attribute) and attribute.__module__ == module.__name__ and not name.startswith("_")
    )
