"""`rollout.thinking` on Qwen3's real tokenizer: which completion tokens are trained, and how prompts render."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.data import PromptRow, encode_prompt
from asyncrl.environments import ChatDelta
from asyncrl.thinking import MASKED, OFF, TRAINED, Thinking, ThinkingError
from demo.tiny.vocabulary import build_tokenizer

THINK, END_THINK, IM_START, IM_END, ASSISTANT = 151667, 151668, 151644, 151645, 77091  # Qwen3's ids
NEWLINE, TWO_NEWLINES = 198, 271
# '<think>\nLet me add: 43*27.\n</think>\n\n1161<|im_end|>' as Qwen3's BPE writes it: the block is ids 0-13
THINKING_TURN = [THINK, NEWLINE, 10061, 752, 912, 25, 220, 19, 18, 9, 17, 22, 624, END_THINK,
                 TWO_NEWLINES, 16, 16, 21, 16, IM_END]
ROW = PromptRow([{"role": "user", "content": "43*27="}], "arithmetic", "1161")


@pytest.fixture(scope="module")
def qwen3():
    return build_tokenizer("qwen3")


def test_the_qwen3_ids_of_the_thinking_turn_are_those_written_above(qwen3):
    text = "<think>\nLet me add: 43*27.\n</think>\n\n1161"
    assert qwen3.encode(text, add_special_tokens=False) + [qwen3.eos_token_id] == THINKING_TURN


def test_masked_drops_the_block_from_think_through_end_think_and_trains_the_answer(qwen3):
    thinking = Thinking.for_tokenizer(MASKED, qwen3)
    assert (thinking.open_id, thinking.close_id, thinking.cue_opens) == (THINK, END_THINK, False)
    assert thinking.loss_mask(THINKING_TURN) == [0] * 14 + [1] * 6  # '\n\n', '1', '1', '6', '1', <|im_end|> trained
    logprobs = [-0.5 - i for i in range(len(THINKING_TURN))]
    mask, kept = thinking.trained(THINKING_TURN, logprobs)
    assert kept == [0.0] * 14 + [-14.5, -15.5, -16.5, -17.5, -18.5, -19.5]  # untrained tokens log-prob 0.0
    # text before the block, and a second block, as a turn may hold
    turn = [16, THINK, 17, END_THINK, 18, THINK, 19, END_THINK, 20]
    assert thinking.loss_mask(turn) == [1, 0, 0, 0, 1, 0, 0, 0, 1]


def test_an_unterminated_block_is_masked_to_the_end_of_the_completion(qwen3):
    cut = THINKING_TURN[:9]  # '<think>\nLet me add: 43' cut by max_tokens
    assert Thinking.for_tokenizer(MASKED, qwen3).loss_mask(cut) == [0] * 9
    answered_then_cut = [16, 16, THINK, NEWLINE, 10061]
    assert Thinking.for_tokenizer(MASKED, qwen3).loss_mask(answered_then_cut) == [1, 1, 0, 0, 0]


@pytest.mark.parametrize("mode", [TRAINED, OFF])
def test_trained_and_off_train_every_completion_token(qwen3, mode):
    logprobs = [-0.25] * len(THINKING_TURN)
    assert Thinking.for_tokenizer(mode, qwen3).trained(THINKING_TURN, logprobs) == ([1] * 20, logprobs)


def test_off_renders_the_empty_think_block_after_every_generation_cue(qwen3):
    off = Thinking.for_tokenizer(OFF, qwen3)
    question = [IM_START, 872, NEWLINE, 19, 18, 9, 17, 22, 28, IM_END, NEWLINE]  # '<|im_start|>user\n43*27=<|im_end|>\n'
    cue = [IM_START, ASSISTANT, NEWLINE]
    empty_block = [THINK, TWO_NEWLINES, END_THINK, TWO_NEWLINES]  # '<think>\n\n</think>\n\n'
    assert encode_prompt(qwen3, ROW, off) == question + cue + empty_block
    assert encode_prompt(qwen3, ROW) == question + cue  # the default (trained): the model opens its own block
    assert ChatDelta(qwen3, off).prompt_ids(ROW.messages) == question + cue + empty_block
    # between turns: the tool's reply, then the cue with its empty block again
    observation = ChatDelta(qwen3, off).observation_ids([{"role": "user", "content": "higher"}], [IM_END])
    assert observation == [NEWLINE, IM_START, 872, NEWLINE, 89347, IM_END, NEWLINE] + cue + empty_block
    assert qwen3.decode(observation[3:5]) == "\nhigher"


def test_off_is_a_no_op_for_a_template_without_thinking():
    char = build_tokenizer("char")
    assert encode_prompt(char, ROW, Thinking.for_tokenizer(OFF, char)) == encode_prompt(char, ROW)


def test_masked_with_a_tokenizer_without_think_tokens_is_refused_naming_the_key():
    with pytest.raises(ThinkingError, match=r"rollout.thinking=masked: the tokenizer has no token for <think> "
                                            r"\(it is 7 tokens\)"):
        Thinking.for_tokenizer(MASKED, build_tokenizer("char"))


def test_a_cue_that_opens_the_block_masks_the_completion_up_to_its_end_think(qwen3):
    # templates of thinking-only models (Qwen3-*-Thinking-2507) write '<think>\n' after the cue: the completion
    # starts inside the block and holds only its end
    opening = build_tokenizer("qwen3")
    opening.chat_template = qwen3.chat_template.replace("{{- '<|im_start|>assistant\\n' }}",
                                                       "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    thinking = Thinking.for_tokenizer(MASKED, opening)
    assert thinking.cue_opens
    assert thinking.loss_mask(THINKING_TURN[2:]) == [0] * 12 + [1] * 6


def test_the_config_key_takes_three_values():
    assert load_config(None, []).rollout.thinking == TRAINED
    assert load_config(None, ["rollout.thinking=masked"]).rollout.thinking == MASKED
    with pytest.raises(ConfigError, match="rollout.thinking"):
        load_config(None, ["rollout.thinking=hidden"])
