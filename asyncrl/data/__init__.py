"""Prompt datasets in verl's layout (parquet or JSONL): reading, validation, mixing, writing."""

from asyncrl.data.mixture import PromptMixture
from asyncrl.data.readers import load_prompt_file, write_rows
from asyncrl.data.rows import DataError, PromptRow, encode_prompt

__all__ = ["DataError", "PromptMixture", "PromptRow", "encode_prompt", "load_prompt_file", "write_rows"]
