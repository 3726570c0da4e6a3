"""Loading, validating and saving configs: YAML file, then `key=value` overrides, then checks.

Every failure raises `ConfigError` whose message names the offending key (or file) before any
process starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from asyncrl.config.fields import CHOICES_KEY, RANGE_KEY
from asyncrl.config.root import AsyncRLConfig


class ConfigError(ValueError):
    """A config file, key or value is invalid. The message names the key or file."""


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> AsyncRLConfig:
    """Build the validated config: defaults, then the YAML file at `path`, then `overrides`."""
    merged = OmegaConf.structured(AsyncRLConfig)
    if path is not None:
        merged = _merge(merged, _read_yaml(Path(path)), f"config file {path}")
    for override in overrides:
        key, value = _parse_override(override)
        merged = _merge(merged, OmegaConf.create(_nested(key, value)), f"override '{override}'")
    config = OmegaConf.to_object(merged)
    assert isinstance(config, AsyncRLConfig)
    problems = _range_problems(config, "") + config.cross_checks()
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {key}: {why}" for key, why in problems))
    return config


def save_config(config: AsyncRLConfig, run_dir: str | Path) -> Path:
    """Write the resolved config into the run directory as `config.yaml`."""
    target = Path(run_dir) / "config.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(to_yaml(config))
    return target


def to_yaml(config: AsyncRLConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = OmegaConf.load(path)
    except Exception as error:  # yaml.YAMLError and friends: report the file, not a traceback
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from error
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(f"config file {path} must hold a mapping of sections at top level")
    return loaded


def _parse_override(override: str) -> tuple[str, Any]:
    """Split `key=value` with hydra's override grammar (lists, quoting); `+`/`~` forms are refused.

    The value is hydra's parse of it, not a second YAML parse of the raw text: YAML reads `::` as a
    mapping and `*` as an alias, so e.g. `buffer.bind_host=::` failed here instead of in its own check."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        (parsed,) = OverridesParser.create().parse_overrides([override])
    except Exception as error:
        raise ConfigError(f"cannot parse override '{override}': expected key=value ({error})") from error
    if parsed.is_add() or parsed.is_delete() or parsed.is_force_add():
        raise ConfigError(f"override '{override}': only plain key=value is supported (no +, ++ or ~)")
    return parsed.key_or_group, parsed.value()


def _nested(dotted_key: str, value: Any) -> dict[str, Any]:
    """{'a': {'b': value}} for 'a.b'."""
    for part in reversed(dotted_key.split(".")):
        value = {part: value}
    return value


def _merge(base: Any, update: Any, origin: str) -> Any:
    try:
        return OmegaConf.merge(base, update)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "?"
        reason = "unknown key" if isinstance(error, ConfigKeyError) else str(error).splitlines()[0]
        raise ConfigError(f"{origin}: key '{key}': {reason}") from error


def _range_problems(section: Any, prefix: str) -> list[tuple[str, str]]:
    """Walk the dataclass tree and report values outside their declared range or choices."""
    problems = []
    for spec in dataclasses.fields(section):
        key, value = f"{prefix}{spec.name}", getattr(section, spec.name)
        if dataclasses.is_dataclass(value):
            problems += _range_problems(value, key + ".")
        elif RANGE_KEY in spec.metadata:
            lo, hi = spec.metadata[RANGE_KEY]
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                problems.append((key, f"{value} is outside [{_end(lo)}, {_end(hi)}]"))
        elif CHOICES_KEY in spec.metadata and value not in spec.metadata[CHOICES_KEY]:
            problems.append((key, f"'{value}' is not one of {list(spec.metadata[CHOICES_KEY])}"))
    return problems


def _end(bound: float | None) -> str:
    return "∞" if bound is None else str(bound)
