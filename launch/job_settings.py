"""One source of truth for a job run as two commands: `asyncrl rollout` takes the job's shared settings from the
learner's resolved config (`config.yaml` in the run directory), so that a setting given to the learner alone
(`learner.total_steps=40`, a data file) holds on both sides. A rollout override that contradicts the learner's
value is refused, naming the key; the rollout's other overrides are its own settings, reported as applied."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

from asyncrl.config import AsyncRLConfig, ConfigError, load_config

# Settings both sides must agree on: what is trained and sampled, the staleness bound, the validation schedule,
# the length of the job and the GPU memory budget both plan in. A key names a section (every setting in it) or one
# setting.
SHARED_KEYS = ("model", "data", "rollout.sampling", "rollout.thinking", "buffer.max_staleness", "validation",
               "learner.total_steps", "learner.mode", "run.seed", "run.gpu_memory_gib")
LEARNER_CONFIG = "config.yaml"  # the learner's resolved config, in the run directory
LEARNER_ONLY = "learner."  # the prefix of settings only the learner reads (but the shared ones above)


def adopt_learner_settings(config: AsyncRLConfig, run_dir: Path, overrides: Sequence[str],
                           log: logging.Logger) -> AsyncRLConfig:
    """`config` with the shared settings of the learner's config in `run_dir` (unchanged when there is none: the
    learner runs elsewhere). ConfigError when one of `overrides` (this command's `key=value`s) contradicts it."""
    path = Path(run_dir) / LEARNER_CONFIG
    if not path.is_file():
        log.info("no learner config at %s: the job's shared settings are this command's own", path)
        return config
    learner = load_config(path)
    given = {override.split("=", 1)[0].strip() for override in overrides}
    mine, theirs = _flat(config), _flat(learner)
    differing = [key for key in theirs if _is_shared(key) and mine[key] != theirs[key]]
    contradicted = [key for key in differing if _given(key, given)]
    if contradicted:
        raise ConfigError("`asyncrl rollout` contradicts the learner's settings of this job (" + str(path) + "):\n" +
                          "\n".join(f"  {key}: {mine[key]!r} given here, {theirs[key]!r} in the learner's config"
                                    for key in contradicted) +
                          "\n  a job's shared settings come from the learner: drop the override, or give it to the learner")
    if differing:
        log.info("taken from the learner's config: %s", ", ".join(f"{key}={theirs[key]!r}" for key in differing))
    # this command's own settings, where they differ from the learner's (the same value is no news)
    own = [key for key in theirs if not _is_shared(key) and mine[key] != theirs[key] and _given(key, given)]
    applied = [f"{key}={mine[key]!r}" for key in own if not key.startswith(LEARNER_ONLY)]
    if applied:
        log.info("rollout settings applied: %s", ", ".join(applied))
    if ignored := [key for key in own if key.startswith(LEARNER_ONLY)]:
        log.warning("learner settings given to `asyncrl rollout` have no effect there: %s", ", ".join(ignored))
    for key in SHARED_KEYS:
        config = _with(config, key, _get(learner, key))
    return config


def _is_shared(key: str) -> bool:
    return any(key == shared or key.startswith(shared + ".") for shared in SHARED_KEYS)


def _given(key: str, given: set[str]) -> bool:
    """Whether an override set `key`, itself or a section holding it."""
    return any(key == name or key.startswith(name + ".") for name in given)


def _flat(section: Any, prefix: str = "") -> dict[str, Any]:
    """Every setting of a config section by its dotted key."""
    flat: dict[str, Any] = {}
    for field in dataclasses.fields(section):
        value, key = getattr(section, field.name), f"{prefix}{field.name}"
        flat |= _flat(value, key + ".") if dataclasses.is_dataclass(value) else {key: value}
    return flat


def _get(section: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        section = getattr(section, name)
    return section


def _with(section: Any, dotted: str, value: Any) -> Any:
    """A copy of `section` whose setting (or subsection) at `dotted` is `value`."""
    name, _, rest = dotted.partition(".")
    return dataclasses.replace(section, **{name: _with(getattr(section, name), rest, value) if rest else value})
