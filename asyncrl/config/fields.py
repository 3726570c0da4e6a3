"""Field helpers for the structured configs: defaults with declared ranges that the loader checks."""

from __future__ import annotations

import dataclasses
from typing import Any

RANGE_KEY = "asyncrl_range"
CHOICES_KEY = "asyncrl_choices"
SPEC_SEPARATOR = ":"  # a user object named in the config: "path/to/file.py:Name" or "package.module:Name"


def bounded(default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    """A scalar field whose value must lie in [lo, hi] (either end may be open)."""
    return dataclasses.field(default=default, metadata={RANGE_KEY: (lo, hi)})


def one_of(default: str, *choices: str) -> Any:
    """A string field restricted to the given choices."""
    return dataclasses.field(default=default, metadata={CHOICES_KEY: (default, *choices)})


def items(*default: Any) -> Any:
    """A list field with a (copied) default."""
    return dataclasses.field(default_factory=lambda: list(default))
