"""Rewards: verl-compatible custom reward functions and built-in scorers, run in a pool of worker processes.

    with RewardScorer(config.reward) as scorer:
        results = scorer.score([RewardRequest("arithmetic", "95", "95")])
"""

from rollout_servers.rewards.builtin import UnknownDataSourceError, compute_score
from rollout_servers.rewards.custom import RewardFunctionError, load_reward_function
from rollout_servers.rewards.pool import WorkerStartError
from rollout_servers.rewards.results import RewardRequest, RewardResult
from rollout_servers.rewards.scorer import RewardScorer, check_reward_setup

__all__ = [
    "RewardFunctionError",
    "RewardRequest",
    "RewardResult",
    "RewardScorer",
    "check_reward_setup",
    "UnknownDataSourceError",
    "WorkerStartError",
    "compute_score",
    "load_reward_function",
]
