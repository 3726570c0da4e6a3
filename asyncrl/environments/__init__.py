"""The multi-turn environment protocol that user environments implement, and the token layout of an episode
(the chat-template delta of each turn, the token-in/token-out transcript). The built-in environments, the
registry by data source and the deadline guards belong to the rollout servers (`rollout_servers.environments`).
See docs/multi_turn.md."""

from asyncrl.environments.base import Environment, Message, ModelTurn, StepResult, Tool
from asyncrl.environments.chat_delta import ChatDelta
from asyncrl.environments.transcript import OBSERVATION_LOGPROB, Transcript

__all__ = ["ChatDelta", "Environment", "Message", "ModelTurn", "OBSERVATION_LOGPROB", "StepResult", "Tool", "Transcript"]
