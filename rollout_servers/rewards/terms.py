"""Which reward functions a scorer runs, and tasks whose reward combines several scorers.

A task (a data source) with terms in `reward.terms` gets the reward Σ weight · term, each term scored by
its own function (or by the task's own reward when the term names no file); every term's value goes to
`reward_info` under its name, and the numeric extras a term returned under `<name>/<entry>`. Tasks without
terms are scored by the custom function or the built-ins as before.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from rollout_servers.rewards.builtin import compute_score
from rollout_servers.rewards.custom import RewardFunction, load_reward_function
from rollout_servers.rewards.results import SCORE_KEY, result_from_return

if TYPE_CHECKING:
    from asyncrl.config.sections import RewardConfig

@dataclass(frozen=True)
class TermSpec:
    data_source: str  # the task the term belongs to
    name: str  # its entry in reward_info
    path: str  # absolute path of its scorer's file; "" = the task's own reward
    function: str  # function name in that file
    weight: float  # factor in the task's reward
    key: str  # its config key (reward.terms[i]), for errors


@dataclass(frozen=True)
class RewardSpec:
    """What a scoring worker loads: plain strings and numbers, sent to spawned processes."""

    path: str  # absolute path of reward.custom_fn's file; "" = the built-ins
    name: str  # its function name
    terms: tuple[TermSpec, ...] = ()  # reward.terms, resolved

    @classmethod
    def from_config(cls, config: RewardConfig) -> RewardSpec:
        """Paths made absolute: workers resolve them, and an absolute one does not depend on where they start."""
        terms = tuple(TermSpec(t.data_source, t.name, _absolute(t.path), t.function, t.weight, f"reward.terms[{index}]")
                      for index, t in enumerate(config.terms))
        return cls(_absolute(config.custom_fn.path), config.custom_fn.name, terms)

    def sources_scored_by_default(self, data_sources: Iterable[str]) -> set[str]:
        """The data sources that the task's own reward scores (no terms, or a term without a file of its own)."""
        own_files = defaultdict(set)
        for term in self.terms:
            own_files[term.data_source].add(bool(term.path))
        return {source for source in data_sources if False in own_files.get(source, {False})}


class CombinedReward:
    """verl's reward-function signature over the configured terms: Σ weight · term for a task with terms,
    the default reward's own return value for any other task. A term that fails raises, naming the term."""

    def __init__(self, default: RewardFunction, terms: dict[str, list[tuple[TermSpec, RewardFunction]]]) -> None:
        self.default, self.terms = default, terms

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        terms = self.terms.get(data_source)
        if not terms:
            return self.default(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                                extra_info=extra_info)
        combined: dict[str, float] = {SCORE_KEY: 0.0}
        for term, function in terms:
            result = result_from_return(function(data_source=data_source, solution_str=solution_str,
                                                 ground_truth=ground_truth, extra_info=extra_info))
            if result.failed:
                raise ValueError(f"reward term '{term.name}' ({term.key}): {result.error}")
            combined[SCORE_KEY] += term.weight * result.score
            combined[term.name] = result.score
            combined |= {f"{term.name}/{entry}": value for entry, value in result.info.items()}
        return combined


def load_reward(spec: RewardSpec) -> RewardFunction:
    """The function a worker scores with: the default reward alone, or the terms around it. Every file is
    loaded now, so a bad one fails here with `RewardFunctionError` naming its key."""
    default = load_reward_function(spec.path, spec.name) if spec.path else compute_score
    if not spec.terms:
        return default
    terms: dict[str, list[tuple[TermSpec, RewardFunction]]] = defaultdict(list)
    for term in spec.terms:
        function = load_reward_function(term.path, term.function, f"{term.key}.path", f"{term.key}.function") if term.path else default
        terms[term.data_source].append((term, function))
    return CombinedReward(default, dict(terms))


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if path else ""
