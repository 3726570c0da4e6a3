"""Multi-turn environments: the protocol, the built-ins, the registry by data source, deadline guards and
the token-in/token-out transcript of an episode. See docs/multi_turn.md."""

from asyncrl.environments.base import Environment, Message, ModelTurn, StepResult, Tool
from asyncrl.environments.chat_delta import ChatDelta
from asyncrl.environments.guard import ENV_ERROR, ENV_TIMEOUT, EnvironmentFailure, GuardedEnvironment
from asyncrl.environments.registry import BUILTIN_ENVIRONMENTS, EnvironmentConfigError, EnvironmentRegistry
from asyncrl.environments.transcript import OBSERVATION_LOGPROB, Transcript

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "ENV_ERROR",
    "ENV_TIMEOUT",
    "ChatDelta",
    "Environment",
    "EnvironmentConfigError",
    "EnvironmentFailure",
    "EnvironmentRegistry",
    "GuardedEnvironment",
    "Message",
    "ModelTurn",
    "OBSERVATION_LOGPROB",
    "StepResult",
    "Tool",
    "Transcript",
]
