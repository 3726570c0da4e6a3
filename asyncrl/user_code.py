"""Loading user code named in the config: a Python file by path, or an object by `path:Name`.

Every problem is raised as `UserCodeError` with the file or module named, so that callers can prefix
the config key it came from.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from asyncrl.config.fields import SPEC_SEPARATOR


def describe_exception(error: BaseException) -> str:
    """The error string recorded for user code (a scorer, an environment) that raised: "ValueError: message"."""
    return f"{type(error).__name__}: {error}"


class UserCodeError(ValueError):
    """User code named in the config cannot be loaded; the message names the file or module."""


def import_file(file: Path, module_prefix: str) -> ModuleType:
    """Run the Python file at `file` as a module named `<module_prefix>_<stem>_<hash of the path>`."""
    if not file.is_file():
        raise UserCodeError(f"file '{file}' does not exist")
    module_name = f"{module_prefix}_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"'{file}' cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    # registered before running it so that code relying on its own module (dataclasses, pickling) works
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a broken user file: report it as such, with its own error chained
        del sys.modules[module_name]
        raise UserCodeError(f"importing '{file}' failed: {describe_exception(error)}") from error
    return module


def import_module(location: str) -> ModuleType:
    """The importable module `location` ("package.module"), or UserCodeError naming it and why not."""
    try:
        return importlib.import_module(location)
    except Exception as error:  # missing or broken module: report it, with its own error chained
        raise UserCodeError(f"importing module '{location}' failed: {describe_exception(error)}") from error


def split_spec(spec: str) -> tuple[str, str]:
    """("path/to/file.py" or "package.module", "Name") of a spec; UserCodeError when it has no such form."""
    location, separator, name = spec.rpartition(SPEC_SEPARATOR)
    if not separator or not location or not name:
        raise UserCodeError(f"'{spec}' is not of the form path/to/file.py:Name or package.module:Name")
    return location, name


def import_location(location: str, module_prefix: str) -> ModuleType:
    """A spec's module: a file when `location` looks like a path (".py" or a separator), else an importable module."""
    if location.endswith(".py") or "/" in location or "\\" in location:
        return import_file(Path(location).expanduser().resolve(), module_prefix)
    return import_module(location)


def load_object(spec: str, module_prefix: str) -> Any:
    """The object named by `spec`: "path/to/file.py:Name" (a file) or "package.module:Name" (importable)."""
    location, name = split_spec(spec)
    module = import_location(location, module_prefix)
    if not hasattr(module, name):
        raise UserCodeError(f"'{location}' defines no '{name}'")
    return getattr(module, name)
