"""The `environment` section: which data sources run as multi-turn episodes, and the episode limits.

A data source listed in `by_source` is played out by its environment (`rollout_servers.environments`): the
rollout server alternates model turns and environment steps, token-in/token-out, and the environment's
rewards are the sample's reward. Other data sources stay single-turn, scored by `reward`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.config.fields import SPEC_SEPARATOR, bounded

# the built-in environments (rollout_servers.environments), by the name `by_source` gives them
BUILTIN_ENVIRONMENT_NAMES = ("calculator", "guess_number")
# Built-in data sources play out in the built-in environment of the same name unless remapped.
BUILTIN_BY_SOURCE = {name: name for name in BUILTIN_ENVIRONMENT_NAMES}


def is_environment_spec(spec: str) -> bool:
    """A built-in name or something of the `path:Class` form (checked for existence only at load)."""
    return spec in BUILTIN_ENVIRONMENT_NAMES or SPEC_SEPARATOR in spec


@dataclass
class EnvironmentConfig:
    by_source: dict[str, str] = field(default_factory=lambda: dict(BUILTIN_BY_SOURCE))  # data_source → built-in name or path/to/file.py:Class
    max_turns: int = bounded(8, 1)  # model turns per episode at most (finish reason "max_turns" beyond)
    max_total_tokens: int = bounded(0, 0)  # prompt + all turns' tokens per episode, at most; 0 = rollout.engine.max_model_len
    episode_timeout_s: float = bounded(120.0, 0.001)  # wall-clock budget of one episode (finish reason "time_budget" beyond)
    call_timeout_s: float = bounded(10.0, 0.001)  # deadline of each reset/step/close call (finish reason "env_timeout" beyond)
    tool_parser: str = ""  # vLLM tool-call parser (ToolParserManager name, e.g. hermes) that reads the model turns of environments with tools() into ModelTurn.tool_calls; empty = such episodes end with env_error

    def cross_checks(self, max_model_len: int) -> list[tuple[str, str]]:
        """Constraints with other sections, as (key, problem) pairs."""
        problems = [(f"environment.by_source.{source}", f"'{spec}' is neither a built-in environment nor path:Class")
                    for source, spec in self.by_source.items() if not is_environment_spec(spec)]
        if self.max_total_tokens > max_model_len:
            problems.append(("environment.max_total_tokens", f"must not exceed rollout.engine.max_model_len={max_model_len}"))
        return problems

    def total_token_limit(self, max_model_len: int) -> int:
        """Tokens per episode at most: the configured cap, or the engine's context length."""
        return self.max_total_tokens or max_model_len
