"""The token record of one multi-turn episode, as the learner receives it.

Model tokens keep the engine's behaviour log-probs and per-token policy versions and have loss mask 1, but for
thinking blocks under `rollout.thinking=masked` (mask 0, log-prob 0.0; `asyncrl.thinking`).
Observation tokens (environment and tool messages, chat-template markup between turns) have loss mask 0,
behaviour log-prob `OBSERVATION_LOGPROB` and the version of the model token just before them (the
episode's start version when no model token precedes them). That version is a placeholder that keeps
every entry a real policy version; the learner ignores masked positions for loss, staleness and
importance weights, so neither placeholder reaches a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from asyncrl.messages import Trajectory
from asyncrl.thinking import UNTRAINED_LOGPROB, Thinking

OBSERVATION_LOGPROB = UNTRAINED_LOGPROB  # behaviour log-prob recorded for tokens the model did not sample


@dataclass
class Transcript:
    prompt_ids: list[int]  # the first prompt, as the engine saw it
    start_version: int  # policy version current when the episode started (versions of leading observations)
    completion_ids: list[int] = field(default_factory=list)  # everything after the prompt, model and observation tokens
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob per completion token
    versions: list[int] = field(default_factory=list)  # policy version per completion token
    loss_mask: list[int] = field(default_factory=list)  # 1 on model tokens, 0 on observation tokens (and masked thinking)

    def context(self) -> list[int]:
        """The next turn's prompt: exactly the ids so far, never re-tokenized."""
        return self.prompt_ids + self.completion_ids

    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def add_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                       thinking: Thinking = Thinking()) -> None:
        """A sampled turn: trained, but for its thinking blocks when `thinking` masks them."""
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(f"model turn of {len(token_ids)} tokens with {len(logprobs)} log-probs "
                             f"and {len(versions)} versions")
        mask, trained_logprobs = thinking.trained(token_ids, logprobs)
        self.completion_ids += token_ids
        self.logprobs += trained_logprobs
        self.versions += versions
        self.loss_mask += mask

    def add_observation(self, token_ids: Sequence[int]) -> None:
        version = self.versions[-1] if self.versions else self.start_version
        self.completion_ids += token_ids
        self.logprobs += [OBSERVATION_LOGPROB] * len(token_ids)
        self.versions += [version] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)

    def untrained(self) -> None:
        """Mask every token: the episode stays in its group but teaches nothing (its environment failed)."""
        self.loss_mask = [0] * len(self.completion_ids)

    def trajectory(self, reward: float, group_id: str, data_source: str, finish_reason: str, num_turns: int,
                   info: dict[str, float] | None = None, error: str = "") -> Trajectory:
        """The episode as the buffer and the learner take it."""
        return Trajectory(
            prompt_ids=self.prompt_ids,
            completion_ids=self.completion_ids,
            behaviour_logprobs=self.logprobs,
            token_versions=self.versions,
            loss_mask=self.loss_mask,
            reward=reward,
            group_id=group_id,
            data_source=data_source,
            finish_reason=finish_reason,
            reward_info=dict(info or {}),
            reward_error=error,
            num_turns=num_turns,
        )
