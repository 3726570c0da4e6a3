"""The tokenizer the tiny model is built on (`model.tiny.tokenizer`): the character tokenizer built here, or a
real model's tokenizer fetched at setup (demo/tiny/pinned_tokenizer.py), loaded from its cache and never
downloaded while a job runs."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from demo.tiny.pinned_tokenizer import PINNED, PinnedTokenizer
from demo.tiny.tokenizer import build_char_tokenizer

CHAR = "char"


def build_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer that `model.tiny.tokenizer=name` selects."""
    return build_char_tokenizer() if name == CHAR else load_pinned(PINNED[name])


def load_pinned(pin: PinnedTokenizer) -> PreTrainedTokenizerBase:
    if not pin.is_cached():
        raise FileNotFoundError(f"model.tiny.tokenizer={pin.name}: its files are not in {pin.cache_dir()}; run "
                                "scripts/setup_env.sh (or python3 scripts/fetch_tokenizer.py), which fetches them "
                                "once: nothing is downloaded while a job runs")
    return AutoTokenizer.from_pretrained(pin.cache_dir())
