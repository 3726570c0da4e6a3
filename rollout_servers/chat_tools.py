"""Tool calls of a chat reply, read by vLLM's own tool-call parser (`rollout.chat.tool_parser`, a name of
its `ToolParserManager`, e.g. `hermes`).

The parser reads the reply's text; the session keeps the sampled ids as they are. The client is shown the
parsed view (`content` and `tool_calls` with ids) and sends it back next turn, where only the new
messages after it are rendered: what is trained is always the exact ids sampled.
"""

from __future__ import annotations

from typing import Any, Sequence

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager


class ToolParserError(ValueError):
    """The configured parser does not exist; the message names the config key."""


class ToolCallReader:
    """One server's parser class and tokenizer; a parser object per reply (parsers keep per-request state)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        try:
            self._parser = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})
            raise ToolParserError(f"rollout.chat.tool_parser: '{name}' is not one of vLLM's tool parsers "
                                  f"({', '.join(known)})") from None
        self._tokenizer = tokenizer

    def read(self, token_ids: Sequence[int], request: ChatCompletionRequest) -> tuple[str | None, list[Any]]:
        """The reply's content and its vLLM `ToolCall`s ([] when it calls no tool)."""
        ids = list(token_ids)
        if ids and ids[-1] == self._tokenizer.eos_token_id:
            ids = ids[:-1]  # vLLM's own text never holds the token that ended the turn
        # Special tokens kept: some templates mark their tool-call tags special (vLLM's hermes parser asks the same)
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        parsed = self._parser(self._tokenizer, request.tools).extract_tool_calls(text, request)
        if not parsed.tools_called:
            return None, []
        return parsed.content, list(parsed.tool_calls)
