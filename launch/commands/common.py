"""What every subcommand does first: load and validate the config, set up logging, make the run dir."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from asyncrl.config import AsyncRLConfig, ConfigError, load_config, save_config
from asyncrl.logs import setup_logging


def load(args: argparse.Namespace) -> AsyncRLConfig:
    """Validated config from --config and the overrides (raises ConfigError naming the key)."""
    return load_config(args.config, args.overrides)


def make_run_dir(config: AsyncRLConfig, command: str) -> Path:
    """Create the run directory and write the resolved config into it."""
    name = config.run.name or f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(config.run.root_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir)
    return run_dir


def start(args: argparse.Namespace, role: str) -> tuple[AsyncRLConfig, logging.Logger]:
    """Load the config and set up logging for `role`."""
    config = load(args)
    return config, setup_logging(role, config.run.log_level)


def check_input_files(config: AsyncRLConfig) -> None:
    """Raise ConfigError naming every local file the rollout side reads that is not there, before any role
    starts: a mistyped path fails at once instead of after the learner and a vLLM engine have started."""
    wanted = [("data.train_files", path) for path in config.data.train_files]
    if config.validation.every:
        wanted += [("data.val_files", path) for path in config.data.val_files]
    if config.reward.custom_fn.path:
        wanted.append(("reward.custom_fn.path", config.reward.custom_fn.path))
    missing = [f"{key}: no file at {path}" for key, path in wanted if not Path(path).is_file()]
    if missing:
        raise ConfigError("input files not found:\n  " + "\n  ".join(missing))
