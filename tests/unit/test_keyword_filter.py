"""`-k` reads which test files to import from their text: only where no test in a skipped file could match."""

from __future__ import annotations

import pytest

from keyword_filter import keyword_words, mentions_any


@pytest.mark.parametrize("expression, words", [
    ("test_frozen_head", ["test_frozen_head"]),
    ("Frozen or (budget and plan)", ["frozen", "budget", "plan"]),
    ("test_grid[cpu-2]", ["test_grid"]),
])
def test_words_of_an_expression_of_words_and_or(expression, words):
    assert keyword_words(expression) == words


@pytest.mark.parametrize("expression", ["", "not slow", "budget and not gpu", "x1", "grid or 12", "ab"])
def test_expressions_a_text_cannot_decide_skip_nothing(expression):
    assert keyword_words(expression) is None


def test_a_file_is_kept_when_its_path_or_text_names_a_word(tmp_path):
    folder = tmp_path / "buffer"
    folder.mkdir()
    module = folder / "test_admission.py"
    module.write_text("class TestLeases:\n    def test_expiry(self): ...\n")

    assert mentions_any(module, ["testleases"])  # -k matches case-insensitively
    assert mentions_any(module, ["buffer"])  # a folder's name is one of its tests' keywords
    assert mentions_any(module, ["nothing", "expiry"])
    assert not mentions_any(module, ["learner", "frozen"])
