"""Token ids of the messages between two model turns, rendered with the chat template as a delta.

A multi-turn prompt is never re-tokenized: turn t+1's prompt is turn t's prompt ids + the ids the engine
sampled + the ids returned here. They are the template's text between the model's content and the next
generation cue, tokenized once:

    closer      the end of the assistant message the template writes after its content ("<|im_end|>\\n"
                for ChatML), less the end-of-turn token when the model sampled it itself;
    observation the observation messages and the generation cue ("<|im_start|>tool\\n42<|im_end|>\\n
                <|im_start|>assistant\\n").

Both come from rendering a fixed two-message conversation with and without the new messages, so
templates that add a default system prompt or rewrite earlier turns only differ in the common prefix.
"""

from __future__ import annotations

from typing import Any, Sequence

from asyncrl.environments.base import Message

_CONTENT_MARK = "ASYNCRL_CONTENT_MARK"  # stands for the model's content while rendering; must not be rewritten
_ANCHOR: list[Message] = [{"role": "user", "content": "."}]  # a conversation to extend (templates want a user first)


class ChatDelta:
    """Renders observation deltas for one tokenizer (its chat template and end-of-turn token)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._assistant = [*_ANCHOR, {"role": "assistant", "content": _CONTENT_MARK}]
        rendered = self._render(self._assistant, generation_cue=False)
        self._after_assistant = rendered  # the anchor conversation through the assistant message
        self.closer = rendered[rendered.rindex(_CONTENT_MARK) + len(_CONTENT_MARK):]
        self.end_of_turn_id: int = tokenizer.eos_token_id
        end_text = tokenizer.decode([self.end_of_turn_id])
        self._closer_after_eos = self.closer[len(end_text):] if self.closer.startswith(end_text) else self.closer

    def prompt_ids(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The first prompt: `messages` rendered with the generation cue (and the function `tools` the
        template describes to the model), tokenized as training prompts are."""
        return list(self._tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True,
                                                        return_dict=False))

    def observation_ids(self, observation: Sequence[Message], model_ids: Sequence[int],
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids that follow the model turn `model_ids` to close it, add `observation` and cue the next turn
        (`tools`: those of the conversation's first prompt, for templates that render later turns with them)."""
        ended = bool(model_ids) and model_ids[-1] == self.end_of_turn_id
        closer = self._closer_after_eos if ended else self.closer
        before = self._render(self._assistant, generation_cue=False, tools=tools) if tools else self._after_assistant
        extended = self._render([*self._assistant, *observation], generation_cue=True, tools=tools)
        if not extended.startswith(before):
            raise ValueError("the chat template rewrites earlier turns when messages are added; "
                             "a token-in/token-out delta cannot be rendered for it")
        text = closer + extended[len(before):]
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _render(self, messages: list[Message], generation_cue: bool, tools: list[dict[str, Any]] | None = None) -> str:
        return self._tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_cue,
                                                   tokenize=False)
