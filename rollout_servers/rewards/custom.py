"""User reward functions in verl's form, loaded from a Python file by path and function name.

Every problem is reported when the function is loaded, at startup, with the file and function named:
a missing file, a file that fails to import, a missing or non-callable name, or a signature that cannot
take verl's four keyword arguments.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from asyncrl.user_code import UserCodeError, import_file

RewardFunction = Callable[..., Any]  # compute_score(data_source, solution_str, ground_truth, extra_info)

# verl calls reward functions with these keywords; a custom function must accept all four
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_SIGNATURE = f"({', '.join(VERL_ARGUMENTS)})"


class RewardFunctionError(ValueError):
    """The custom reward function cannot be used. The message names the file and the function."""


def load_reward_function(path: str | Path, name: str, path_key: str = "reward.custom_fn.path",
                         name_key: str = "reward.custom_fn.name") -> RewardFunction:
    """The function `name` defined in the Python file at `path`, checked against verl's signature; errors
    name the config keys that set the file (`path_key`) and the function (`name_key`)."""
    file = Path(path).expanduser().resolve()
    module = _import_file(file, path_key)
    function = _find_function(module, file, name, name_key)
    _check_signature(function, file, name, name_key)
    return function


def _import_file(file: Path, key: str) -> ModuleType:
    try:
        return import_file(file, "asyncrl_reward")
    except UserCodeError as error:
        message = str(error).replace("file '", "reward function file '", 1)
        raise RewardFunctionError(f"{key}: {message}") from error


def _find_function(module: ModuleType, file: Path, name: str, key: str) -> RewardFunction:
    if not hasattr(module, name):
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise RewardFunctionError(
            f"{key}: '{file}' defines no '{name}' (functions there: {', '.join(defined) or 'none'})"
        )
    function = getattr(module, name)
    if not callable(function):
        raise RewardFunctionError(
            f"{key}: '{name}' in '{file}' is a {type(function).__name__}, not a function"
        )
    if inspect.iscoroutinefunction(function):
        raise RewardFunctionError(
            f"{key}: '{name}' in '{file}' is async; reward functions run in worker processes "
            "and must be plain functions"
        )
    return function


def _check_signature(function: RewardFunction, file: Path, name: str, key: str) -> None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # builtins without introspectable signatures: trust the call
        return
    try:
        signature.bind(**{argument: None for argument in VERL_ARGUMENTS})
    except TypeError as error:
        raise RewardFunctionError(
            f"{key}: '{name}' in '{file}' has signature {signature}; expected {name}{VERL_SIGNATURE} "
            f"({error})"
        ) from error
