"""Which test files a `-k` expression can select, read from their text without importing them."""

from __future__ import annotations

import functools
import re
from pathlib import Path

# `-k` words shorter than this, or all digits, may match generated parameter ids: no file is skipped for them
SHORTEST_FILTERED_WORD = 3


def keyword_words(expression: str) -> list[str] | None:
    """The words of a `-k` expression made only of words, `and`, `or` and parentheses, lower-cased (a parameter id's
    brackets cut off); None for an empty expression or one that a file's text cannot decide (`not`, short or numeric
    words)."""
    tokens = re.findall(r"[()]|[^\s()]+", expression.lower())
    words = [token.split("[")[0] for token in tokens if token not in ("(", ")", "and", "or")]
    safe = "not" not in tokens and all(len(word) >= SHORTEST_FILTERED_WORD and not word.isdigit() for word in words)
    return words if words and safe else None


def mentions_any(path: Path, words: list[str]) -> bool:
    """Whether the file's path or text contains one of `words` (lower-case), as every name `-k` matches must: its
    tests, classes, markers, module and folders."""
    text = _searchable_text(path)
    return any(word in text for word in words)


@functools.lru_cache(maxsize=None)
def _searchable_text(path: Path) -> str:
    """The file's path and text, lower-cased. Cached: collection asks again for each folder above the file."""
    return f"{path}\n{path.read_text(errors='replace')}".lower()
