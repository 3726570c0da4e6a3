"""One prompt row in verl's layout, validated field by field with errors that name file, row and field."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl.thinking import Thinking

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")


ROW_MAX_TOKENS_KEY = "max_tokens"  # extra_info field: this row's responses stop at this many tokens (at most)


class DataError(ValueError):
    """A data file or row is unusable; the message names the file, the row and the field."""


@dataclass(frozen=True)
class PromptRow:
    messages: list[dict[str, str]]  # chat list: [{"role": ..., "content": ...}, ...]
    data_source: str  # selects the scorer / environment and groups metrics
    ground_truth: str  # reward_model.ground_truth, as a string
    ability: str = ""  # verl's task family label
    reward_style: str = "rule"  # reward_model.style
    extra_info: dict[str, Any] = field(default_factory=dict)  # passed through to the reward function
    source_file: str = ""  # file the row came from
    row_index: int = -1  # 0-based row number in that file


def parse_row(raw: Any, source_file: str, row_index: int) -> PromptRow:
    """Validate one raw row (a dict from parquet or JSONL)."""
    where = f"{source_file}, row {row_index}"
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object with verl's fields, got {type(raw).__name__}")
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DataError(f"{where}: field 'reward_model' must be an object with 'ground_truth'")
    data_source = raw.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise DataError(f"{where}: field 'data_source' must be a non-empty string")
    extra_info = raw.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{where}: field 'extra_info' must be an object")
    cap = extra_info.get(ROW_MAX_TOKENS_KEY)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise DataError(f"{where}: field 'extra_info.{ROW_MAX_TOKENS_KEY}' must be a positive integer, got {cap!r}")
    return PromptRow(
        messages=_parse_messages(raw.get("prompt"), where),
        data_source=data_source,
        ground_truth=_ground_truth_text(reward_model["ground_truth"]),
        ability=str(raw.get("ability") or ""),
        reward_style=str(reward_model.get("style") or "rule"),
        extra_info=extra_info,
        source_file=source_file,
        row_index=row_index,
    )


def encode_prompt(tokenizer: "PreTrainedTokenizerBase", row: PromptRow, thinking: Thinking = Thinking()) -> list[int]:
    """Token ids of the row's chat, rendered by the tokenizer's chat template with the generation cue (and the
    template options of `thinking`)."""
    return list(tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, return_dict=False,
                                              **thinking.template_options()))


def _parse_messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataError(f"{where}: field 'prompt' must be a non-empty chat list or a string")
    messages = []
    for turn, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DataError(f"{where}: field 'prompt[{turn}]' must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: field 'prompt[{turn}].role' is {role!r}, expected one of {list(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: field 'prompt[{turn}].content' must be a string")
        messages.append({"role": role, "content": content})
    return messages


def _ground_truth_text(value: Any) -> str:
    """verl datasets hold answers as strings, numbers or lists; the scorers take text."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)
