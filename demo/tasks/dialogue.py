"""Supervised examples of multi-turn episodes, tokenized exactly as the agent loop assembles them
(`ChatDelta` + `Transcript`): the warm start teaches the token sequences RL will sample and train on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.environments import ChatDelta, Message, Tool, Transcript

IGNORE_INDEX = -100  # label value that cross-entropy skips (prompt and observation positions)
_UNUSED = 0  # log-prob/version of teacher tokens: a supervised example has neither


@dataclass(frozen=True)
class Dialogue:
    """A teacher's episode: the first messages, then (model turn text, observation messages) per turn;
    the last turn's observation is empty (the episode ended)."""

    messages: list[Message]
    turns: list[tuple[str, list[Message]]]
    tools: list[Tool] | None = None  # function tools the chat template lists in the prompt (as the environment's `tools()`)


def dialogue_example(tokenizer: Any, chat: ChatDelta, dialogue: Dialogue) -> tuple[list[int], list[int]]:
    """Input ids and labels: model turns (and their end-of-turn tokens) are learned, the rest is not."""
    transcript = Transcript(chat.prompt_ids(dialogue.messages, dialogue.tools), start_version=_UNUSED)
    for text, observation in dialogue.turns:
        turn_ids = tokenizer.encode(text, add_special_tokens=False) + [chat.end_of_turn_id]
        transcript.add_model_turn(turn_ids, [_UNUSED] * len(turn_ids), [_UNUSED] * len(turn_ids))
        if observation:
            transcript.add_observation(chat.observation_ids(observation, turn_ids, dialogue.tools))
    labels = [IGNORE_INDEX] * len(transcript.prompt_ids)
    labels += [token if trained else IGNORE_INDEX for token, trained in zip(transcript.completion_ids, transcript.loss_mask)]
    return transcript.context(), labels
