"""Hydra structured configs: one dataclass per section, loaded from YAML plus key=value overrides."""

from asyncrl.config.loader import ConfigError, load_config, save_config, to_yaml
from asyncrl.config.root import AsyncRLConfig

__all__ = ["AsyncRLConfig", "ConfigError", "load_config", "save_config", "to_yaml"]
