"""A character-level tokenizer with a ChatML chat template, saved as a standard Hugging Face tokenizer.

Every printable ASCII character and the newline is one token; the chat markers are special tokens.
It is built as a byte-level BPE without merges, the form of Qwen2's own tokenizer: transformers (and
so vLLM) load a Qwen2 model's tokenizer as `Qwen2Tokenizer`, which rebuilds a byte-level pipeline
from the vocabulary, and a vocabulary of byte-level symbols makes that rebuild tokenize exactly as
this one does. Encode → decode is the identity on the supported alphabet.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS_EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS_EOS, IM_START, IM_END]
UNKNOWN = "?"  # characters outside the alphabet map to this token
ALPHABET = string.printable[:95] + "\n"  # printable ASCII (space included) and newline

# Tools (the chat endpoint's `tools`) go into a system message, one JSON line each (every character is a
# token here: the model's 256 positions leave no room for instructions), and calls are written as vLLM's
# `hermes` parser reads them; without tools or tool calls a conversation renders as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] if call['function']['arguments'] is string else call['function']['arguments'] | tojson }}"
    "{{ '}</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer object; `save_pretrained(dir)` writes the standard files."""
    symbols = SPECIAL_TOKENS + [byte_level_symbol(character) for character in ALPHABET]
    core = Tokenizer(models.BPE(vocab={symbol: index for index, symbol in enumerate(symbols)}, merges=[], unk_token=UNKNOWN))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
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


_SHIFTED_BYTES = 256  # byte-level BPE maps each non-printable byte b (< 33 here) to chr(256 + b)
_FIRST_PRINTABLE = 33  # "!": from here to "~" a byte is its own symbol


def byte_level_symbol(character: str) -> str:
    """The byte-level BPE symbol of an ASCII character (GPT-2's byte-to-unicode table)."""
    code = ord(character)
    return character if code >= _FIRST_PRINTABLE else chr(_SHIFTED_BYTES + code)
