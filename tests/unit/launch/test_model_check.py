"""The start checks of a job's model (launch/commands/model_check.py): a tokenizer that loads, a chat template, an
EOS token (or the job's own stop ids), and a tool parser whose call tags the template writes; each refusal names
the key and the missing piece."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from demo.tiny.tokenizer import build_char_tokenizer
from launch.commands.model_check import check_model


def saved_tokenizer(directory: Path, **changes) -> Path:
    """The tiny character tokenizer saved to `directory`, with `changes` set on it (None removes a piece)."""
    tokenizer = build_char_tokenizer()
    for name, value in changes.items():
        setattr(tokenizer, name, value)
    tokenizer.save_pretrained(directory)
    return directory


def check(model: Path, *overrides: str) -> None:
    check_model(load_config(None, [f"model.path={model}", *overrides]))


def test_the_tiny_tokenizer_passes_with_and_without_the_hermes_parser(tmp_path):
    model = saved_tokenizer(tmp_path / "tiny")
    check(model)
    check(model, "environment.tool_parser=hermes", "rollout.chat.tool_parser=hermes")


def test_a_path_with_no_tokenizer_is_refused_naming_model_path(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path: nothing at .*missing"):
        check(tmp_path / "missing")


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    model = saved_tokenizer(tmp_path / "plain", chat_template=None)
    with pytest.raises(ConfigError, match="has no chat template") as refused:
        check(model)
    assert str(model) in str(refused.value) and "EOS" not in str(refused.value)


def test_a_tokenizer_without_eos_is_refused_unless_the_job_sets_stop_ids(tmp_path):
    model = saved_tokenizer(tmp_path / "no_eos", eos_token=None)
    with pytest.raises(ConfigError, match="has no EOS token"):
        check(model)
    check(model, "rollout.sampling.stop_token_ids=[3]")


def test_a_tagged_tool_parser_needs_a_template_that_writes_its_tags(tmp_path):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    model = saved_tokenizer(tmp_path / "no_calls", chat_template=template)
    check(model)  # no parser set: nothing to match
    with pytest.raises(ConfigError) as refused:
        check(model, "environment.tool_parser=hermes", "rollout.chat.tool_parser=hermes")
    message = str(refused.value)
    assert "environment.tool_parser=hermes" in message and "rollout.chat.tool_parser=hermes" in message
    assert "<tool_call>" in message
