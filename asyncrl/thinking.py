"""What rollouts do with the model's thinking blocks (`rollout.thinking`), for one tokenizer.

    trained  the chat template renders as it does by default; `<think>` ... `</think>` tokens are trained like
             every other completion token
    masked   the same rendering; in each completion the tokens from `<think>` through `</think>` get loss mask 0
             (and behaviour log-prob 0.0, as every untrained token): the model may think, and only what follows
             its thinking is trained. A block left open (the completion cut by its token cap) is masked to the
             end of the completion: all of it is unfinished thinking. A template whose generation cue opens the
             block itself (the completion starts inside it) is handled: the completion is masked up to its
             `</think>`
    off      the template is rendered with `enable_thinking=False` (Qwen3's writes an empty think block after the
             generation cue, so the model answers at once); a template that knows no such option ignores it

Every place that renders the template (single-turn prompts, validation, multi-turn deltas, the chat endpoint,
the warm start) takes its options from here, and every place that records a completion takes its mask from
here, so one setting holds for the whole job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

TRAINED, MASKED, OFF = "trained", "masked", "off"
CONFIG_KEY = "rollout.thinking"
OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
UNTRAINED_LOGPROB = 0.0  # behaviour log-prob recorded for a completion token that is not trained
_PROBE: list[dict[str, str]] = [{"role": "user", "content": "."}]  # a conversation whose generation cue is read


class ThinkingError(ValueError):
    """`rollout.thinking` cannot work with this tokenizer; the message names the key."""


@dataclass(frozen=True)
class Thinking:
    mode: str = TRAINED
    open_id: int = -1  # the `<think>` token (masked mode only)
    close_id: int = -1  # the `</think>` token (masked mode only)
    cue_opens: bool = False  # the template's generation cue ends inside an open think block

    @classmethod
    def for_tokenizer(cls, mode: str, tokenizer: Any) -> Thinking:
        """The rule of `mode` for `tokenizer`; ThinkingError when masking is asked of a tokenizer that has no
        single `<think>` and `</think>` tokens (the blocks could not be found in the sampled ids)."""
        if mode not in (TRAINED, MASKED, OFF):
            raise ThinkingError(f"{CONFIG_KEY}: {mode!r} is not one of {[TRAINED, MASKED, OFF]}")
        if mode != MASKED:
            return cls(mode)
        open_id, close_id = (_single_token(tokenizer, tag) for tag in (OPEN_TAG, CLOSE_TAG))
        cue = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
        bare = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=False, tokenize=False)
        cue_tail = cue[len(bare):] if cue.startswith(bare) else cue
        return cls(mode, open_id, close_id, cue_tail.rfind(OPEN_TAG) > cue_tail.rfind(CLOSE_TAG))

    def template_options(self) -> dict[str, Any]:
        """Extra variables for `apply_chat_template`."""
        return {"enable_thinking": False} if self.mode == OFF else {}

    def loss_mask(self, token_ids: Sequence[int]) -> list[int]:
        """Loss mask of one completion (one model turn): 1 per token, 0 on its thinking blocks when masked."""
        if self.mode != MASKED:
            return [1] * len(token_ids)
        mask, inside = [], self.cue_opens
        for token in token_ids:
            inside = inside or token == self.open_id
            mask.append(0 if inside else 1)
            inside = inside and token != self.close_id
        return mask

    def trained(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> tuple[list[int], list[float]]:
        """The completion's loss mask and its behaviour log-probs with `UNTRAINED_LOGPROB` where the mask is 0."""
        mask = self.loss_mask(token_ids)
        return mask, [logprob if kept else UNTRAINED_LOGPROB for logprob, kept in zip(logprobs, mask)]


def _single_token(tokenizer: Any, tag: str) -> int:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    if len(ids) != 1:
        raise ThinkingError(f"{CONFIG_KEY}=masked: the tokenizer has no token for {tag} (it is {len(ids)} tokens), "
                            "so thinking blocks cannot be found in the sampled ids; use trained or off")
    return ids[0]
