"""Name → function registries for the learner's pluggable parts (policy losses, advantage estimators).

A config value is either a registered name or a reference to a user's own function, so a new loss
needs no edit of the learner:
- `path/to/file.py:function` imports the file (relative paths from the working directory);
- `package.module:function` imports an installed or importable module.
Every failure raises `RegistryError` naming the config key, the value, and what was missing.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)

REFERENCE_FORMS = "'path/to/file.py:function' or 'package.module:function'"


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
        source, _, function_name = value.rpartition(":")
        if not source or not function_name:
            raise self._error(value, f"expected {REFERENCE_FORMS}")
        module = self._load_file(value, source) if _is_file_path(source) else self._import_module(value, source)
        return self._find_function(value, module, source, function_name)

    def _load_file(self, value: str, source: str) -> ModuleType:
        file = Path(source).expanduser().resolve()
        if not file.is_file():
            raise self._error(value, f"file '{file}' does not exist")
        module_name = _module_name_for(file)
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise self._error(value, f"'{file}' cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # before running it, so dataclasses in the file can find their module
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # the user's file is broken: say so, keeping its own error chained
            del sys.modules[module_name]
            raise self._error(value, f"importing '{file}' failed: {type(error).__name__}: {error}") from error
        return module

    def _import_module(self, value: str, source: str) -> ModuleType:
        try:
            return importlib.import_module(source)
        except Exception as error:  # missing or broken module: report it under the config key
            raise self._error(value, f"cannot import module '{source}': {type(error).__name__}: {error}") from error

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


def _is_file_path(source: str) -> bool:
    return source.endswith(".py") or "/" in source or "\\" in source


def _module_name_for(file: Path) -> str:
    """A module name unique per file, so two user files with the same stem do not replace each other."""
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
    return f"asyncrl_user_{file.stem}_{digest}"
