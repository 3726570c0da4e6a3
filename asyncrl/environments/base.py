"""The `Environment` protocol of multi-turn episodes.

One environment object serves one episode (a fresh one per sample): `reset(sample)` gives the messages
the conversation starts with, then each model turn goes to `step`, which answers with observation
messages (a tool result, the game's feedback), a reward and whether the episode is over. Both are
coroutines; the rollout server bounds each call by `environment.call_timeout_s` and the whole episode
by `environment.episode_timeout_s`. A call that raises or runs past its deadline ends the episode with a
recorded failure. Blocking work (a subprocess, a sandbox, a web request) belongs in `asyncio.to_thread`
or an async client: a call that blocks the event loop cannot be timed out and stalls the server.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from asyncrl.data import PromptRow

Message = dict[str, str]  # {"role": "user" | "tool" | "system" | "assistant", "content": "..."} (a tool message may add "tool_call_id")
Tool = dict[str, Any]  # an OpenAI function tool: {"type": "function", "function": {"name", "description"?, "parameters"?}}


@dataclass(frozen=True)
class ModelTurn:
    """What the policy produced in one turn."""

    text: str  # the turn's tokens decoded without special tokens
    token_ids: list[int]  # the sampled token ids, end-of-turn token included when the model emitted it
    finish_reason: str  # vLLM's: "stop" (end of turn or stop string), "length" (turn token cap)
    turn: int  # 0-based number of this model turn in the episode
    # The turn's function calls as vLLM's tool parser (environment.tool_parser) read them, in OpenAI's form
    # {"id", "type": "function", "function": {"name", "arguments" (JSON text)}}; empty without `tools()`
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class StepResult:
    """An environment's answer to one model turn."""

    observation: list[Message] = field(default_factory=list)  # appended to the conversation; ignored when done
    reward: float = 0.0  # this step's reward; the episode's reward is the sum over its steps
    done: bool = False  # True ends the episode (finish reason "env_done")
    info: dict[str, float] = field(default_factory=dict)  # numeric extras, kept in Trajectory.reward_info (last wins)


class Environment(ABC):
    """Subclass this (or provide the same coroutines) and name the class in `environment.by_source`."""

    @abstractmethod
    async def reset(self, sample: PromptRow) -> list[Message]:
        """The messages the episode starts with (usually `sample.messages`, perhaps with a system prompt)."""

    @abstractmethod
    async def step(self, turn: ModelTurn) -> StepResult:
        """React to the model's turn: observation messages, reward, done."""

    def tools(self) -> list[Tool] | None:
        """The function tools the chat template lists in the first prompt (called after `reset`); the model's
        calls of them come parsed in `ModelTurn.tool_calls`. None: no tools (the default)."""
        return None

    async def close(self) -> None:
        """Release what the episode held (called once after the last step, also after a failure)."""
