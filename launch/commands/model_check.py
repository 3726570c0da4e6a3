"""What a job needs of its model's tokenizer, checked as the job starts (`asyncrl run`: while its roles start, which
a failure stops; `asyncrl rollout`: before any server starts): a model the servers cannot render prompts for, stop,
or read tool calls from fails here with the missing piece named, not minutes later in a server's log.

- a tokenizer loads from `model.path` (a Hugging Face model directory);
- it has a chat template: every prompt is a list of chat messages, rendered with it;
- it has an EOS token, unless `rollout.sampling.stop_token_ids` ends responses: else each runs to its token cap;
- a tool parser that reads tagged calls (hermes: `<tool_call>`) is set only for a template that writes those tags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.config import AsyncRLConfig, ConfigError


def check_model(config: AsyncRLConfig) -> None:
    """Raise ConfigError naming every piece of the tokenizer at `model.path` that the job needs and lacks."""
    tokenizer = load_tokenizer(config.model.path)
    problems = tokenizer_problems(tokenizer, config.model.path, stops=bool(config.rollout.sampling.stop_token_ids))
    problems += parser_problems(tokenizer, config)
    if problems:
        raise ConfigError(f"the model at {config.model.path} cannot serve this job:\n  " + "\n  ".join(problems))


def load_tokenizer(path: str) -> Any:
    """The tokenizer at `path` (a local directory, or a model id in the local Hugging Face cache); ConfigError
    naming model.path where none loads."""
    from transformers import AutoTokenizer  # heavy: after the config is known to be valid

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        where = f"nothing at {path}" if not Path(path).exists() else f"no tokenizer loads from {path} ({error})"
        raise ConfigError(f"model.path: {where}: point it at a Hugging Face model directory "
                          "(`asyncrl init-model` builds the tiny one there)") from error


def tokenizer_problems(tokenizer: Any, path: str, stops: bool) -> list[str]:
    """The chat template and EOS token missing from `tokenizer`; `stops`: stop ids of the job's own end responses."""
    problems = []
    if not tokenizer.chat_template:
        problems.append(f"model.path: the tokenizer at {path} has no chat template (chat_template in "
                        "tokenizer_config.json, or chat_template.jinja): prompts are chat messages rendered with it")
    if tokenizer.eos_token_id is None and not stops:
        problems.append(f"model.path: the tokenizer at {path} has no EOS token (eos_token in tokenizer_config.json): "
                        "without it, or rollout.sampling.stop_token_ids, every response runs to its token cap")
    return problems


def parser_problems(tokenizer: Any, config: AsyncRLConfig) -> list[str]:
    """A tool parser whose call tags the chat template never writes: the model is never shown calls it could read."""
    parsers = {"environment.tool_parser": config.environment.tool_parser,
               "rollout.chat.tool_parser": config.rollout.chat.tool_parser}  # the settings naming a vLLM tool parser
    if not any(parsers.values()):
        return []
    from rollout_servers.chat.call_grammar import LAYOUTS, TaggedCalls  # imports vLLM: only where a parser is set

    template = str(tokenizer.chat_template or "")
    problems = []
    for key, parser in parsers.items():
        layout = LAYOUTS.get(parser)
        if isinstance(layout, TaggedCalls) and template and layout.begin not in template:
            problems.append(f"{key}={parser} reads calls written as {layout.begin}...{layout.end}, but the chat "
                            "template never writes one: set the parser of this model's family, or leave it empty")
    return problems
