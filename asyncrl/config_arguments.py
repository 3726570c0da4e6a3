"""The `--config FILE` and `KEY=VALUE` arguments of the command lines that load a config (light: no OmegaConf)."""

from __future__ import annotations

import argparse

CONFIG_HELP = "YAML config file (hydra structured config); unset keys keep their defaults"
OVERRIDES_HELP = "config overrides as key=value, e.g. run.seed=1 data.train_files=[a.parquet,b.jsonl]"


def add_config_arguments(parser: argparse.ArgumentParser, default: str | None = None,
                         overrides_help: str = OVERRIDES_HELP) -> None:
    """`--config/-c FILE` (`default` when not given) and the positional `overrides`, as `load_config` takes them."""
    config_help = CONFIG_HELP if default is None else f"{CONFIG_HELP} (default: %(default)s)"
    parser.add_argument("--config", "-c", metavar="FILE", default=default, help=config_help)
    add_overrides_argument(parser, overrides_help)


def add_overrides_argument(parser: argparse.ArgumentParser, help_text: str = OVERRIDES_HELP) -> None:
    """The positional `overrides` alone, for a command line that picks its config file itself."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=help_text)
