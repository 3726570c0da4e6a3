"""Token ids of the messages between two model turns, rendered with the chat template as a delta.

A multi-turn prompt is never re-tokenized: turn t+1's prompt is turn t's prompt ids + the ids the engine
sampled + the ids returned here. Re-tokenizing the text would not give the sampled ids back with a BPE
tokenizer (a turn sampled as '"argu' + 'ments"' re-tokenizes as '"arguments"'), and the learner would train
tokens the policy never produced. The delta is the template's text after the model's content, tokenized once:

    closer      the end of the assistant message the template writes after its content ("<|im_end|>\\n"
                for ChatML), less the end-of-turn token when the model sampled it itself;
    observation the observation messages and the generation cue ("<|im_start|>tool\\n42<|im_end|>\\n
                <|im_start|>assistant\\n").

Both are cut, after a marker standing for the model's content, from one render of a fixed conversation
extended by the new messages. What the template writes before that content does not matter: those ids
were fixed when they were sampled or rendered. So templates that render earlier turns differently once
later messages exist (Qwen3's drops the empty thinking block of a turn that is no longer the last) work.
"""

from __future__ import annotations

from typing import Any, Sequence

from asyncrl.environments.base import Message
from asyncrl.thinking import Thinking

_CONTENT_MARK = "ASYNCRL_CONTENT_MARK"  # stands for the model's content while rendering; must not be rewritten
_ANCHOR: list[Message] = [{"role": "user", "content": "."}]  # a conversation to extend (templates want a user first)


class ChatDelta:
    """Renders observation deltas for one tokenizer (its chat template and end-of-turn token), with the template
    options of `thinking` (`rollout.thinking=off` renders every generation cue with its empty think block)."""

    def __init__(self, tokenizer: Any, thinking: Thinking = Thinking()) -> None:
        self._tokenizer = tokenizer
        self._options = thinking.template_options()
        self._assistant = [*_ANCHOR, {"role": "assistant", "content": _CONTENT_MARK}]
        self.end_of_turn_id: int = tokenizer.eos_token_id
        self._end_of_turn_text: str = tokenizer.decode([self.end_of_turn_id])

    def prompt_ids(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The first prompt: `messages` rendered with the generation cue (and the function `tools` the
        template describes to the model), tokenized as training prompts are."""
        return list(self._tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True,
                                                        return_dict=False, **self._options))

    def observation_ids(self, observation: Sequence[Message], model_ids: Sequence[int],
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids that follow the model turn `model_ids` to close it, add `observation` and cue the next turn
        (`tools`: those of the conversation's first prompt, for templates that render later turns with them)."""
        rendered = self._tokenizer.apply_chat_template([*self._assistant, *observation], tools=tools,
                                                       add_generation_prompt=True, tokenize=False, **self._options)
        if rendered.count(_CONTENT_MARK) != 1:
            raise ValueError("the chat template does not write an assistant message's content as it is; "
                             "a token-in/token-out delta cannot be rendered for it")
        text = rendered[rendered.index(_CONTENT_MARK) + len(_CONTENT_MARK):]
        ended = bool(model_ids) and model_ids[-1] == self.end_of_turn_id
        if ended and text.startswith(self._end_of_turn_text):  # the model closed its turn itself: not twice
            text = text[len(self._end_of_turn_text):]
        return list(self._tokenizer.encode(text, add_special_tokens=False))
