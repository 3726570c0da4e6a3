"""A character-level tokenizer with a ChatML chat template, saved as a standard Hugging Face tokenizer.

Every printable ASCII character and the newline is one token; the chat markers are special tokens.
Decoding concatenates tokens, so encode → decode is the identity on the supported alphabet.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS_EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS_EOS, IM_START, IM_END]
UNKNOWN = "?"  # characters outside the alphabet map to this token
ALPHABET = string.printable[:95] + "\n"  # printable ASCII (space included) and newline

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer object; `save_pretrained(dir)` writes the standard files."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNKNOWN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNKNOWN,
        pad_token=PAD,
        bos_token=BOS_EOS,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
