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


def test_a_file_is_read_once_however_many_folders_ask(tmp_path, monkeypatch):
    module = tmp_path / "test_reads.py"
    module.write_text("def test_once(): ...\n")
    reads = []
    read_text = type(module).read_text
    monkeypatch.setattr(type(module), "read_text", lambda self, **kw: reads.append(self) or read_text(self, **kw))

    # the file, its folder and the folder above it ask in turn, as collection does
    assert [mentions_any(module, ["once"]), mentions_any(module, ["other"]), mentions_any(module, ["once"])] == [
        True, False, True]
    assert reads == [module]
