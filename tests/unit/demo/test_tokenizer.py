"""The character-level tokenizer: lossless round trip, chat template, reload as a standard HF tokenizer."""

import string

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, Qwen2Config

from asyncrl.data import PromptRow, encode_prompt
from demo.tiny.tokenizer import ALPHABET, IM_END, SPECIAL_TOKENS, build_char_tokenizer

TOKENIZER = build_char_tokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=60))
def test_encode_decode_is_identity_one_token_per_character(text):
    assume(not any(special in text for special in SPECIAL_TOKENS))  # those strings are one token each
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert TOKENIZER.decode(ids) == text


def test_special_tokens_are_single_ids_and_eos_is_im_end():
    ids = TOKENIZER.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert len(ids) == 1 + len("user\nhi") + 1
    assert TOKENIZER.eos_token == IM_END and ids[-1] == TOKENIZER.eos_token_id


def test_chat_template_and_reload_beside_a_qwen2_config(tmp_path):
    row = PromptRow(messages=[{"role": "user", "content": "12+3=\n x"}], data_source="arithmetic", ground_truth="15")
    ids = encode_prompt(TOKENIZER, row)
    assert TOKENIZER.decode(ids) == "<|im_start|>user\n12+3=\n x<|im_end|>\n<|im_start|>assistant\n"
    # Beside a qwen2 config.json, transformers (and vLLM) load the tokenizer as Qwen2Tokenizer, which
    # rebuilds its own byte-level pipeline: it must tokenize exactly like the tokenizer we built.
    Qwen2Config(vocab_size=len(TOKENIZER)).save_pretrained(tmp_path)
    TOKENIZER.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert encode_prompt(reloaded, row) == ids
    assert reloaded.decode(reloaded.encode(string.printable[:95], add_special_tokens=False)) == string.printable[:95]
