"""A chat reply in OpenAI's shapes: the whole `chat.completion` body, or server-sent `chat.completion.chunk`
events written while the turn is sampled. Both are built from vLLM's own protocol types.

A stream is: a role chunk (`{"role": "assistant", "content": ""}`), content chunks as tokens arrive (each
with its tokens' log-probs when asked), a chunk with `finish_reason` (and the tool calls, if the reply
is one), a usage chunk when `stream_options.include_usage`, then `data: [DONE]`. The HTTP response starts
with the first tokens, so every refusal before sampling is still an ordinary HTTP error status.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from aiohttp import web
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)

from rollout_servers.chat.sessions import Reply
from rollout_servers.vllm_compat import DeltaFunctionCall, DeltaMessage, DeltaToolCall, UsageInfo

log = logging.getLogger(__name__)

UNFINISHED_CHARACTER = "\ufffd"  # what decoding yields for the first bytes of a character split across tokens
TOOL_CALLS = "tool_calls"  # finish reason of a reply that calls tools
CLIENT_GONE = 499  # status of a streamed reply whose client left before it started (nobody reads it)


@dataclass(frozen=True)
class ReplyShape:
    """What one request asked to see of its reply."""

    session_id: str
    model: str  # the served model's name
    logprobs: bool  # the sampled tokens' log-probs
    include_usage: bool  # streams: a last chunk with the token counts
    holds_back_content: bool  # tool calls are parsed from the whole reply: stream no content before it ends


class ReplyFormat:
    """Builds the bodies and chunks of one reply (one id and creation time for all of them)."""

    def __init__(self, shape: ReplyShape, token_texts: Callable[[Sequence[int]], list[str]]) -> None:
        self.shape = shape
        self._token_texts = token_texts
        self._id = f"chatcmpl-{uuid.uuid4().hex}"
        self._created = int(time.time())

    def completion(self, reply: Reply) -> dict[str, Any]:
        """The non-streamed `chat.completion` body."""
        message = ChatMessage(role="assistant", content=reply.content, tool_calls=reply.tool_calls)
        choice = ChatCompletionResponseChoice(index=0, message=message, finish_reason=finish_reason(reply),
                                              logprobs=self.logprobs(reply.completion.token_ids, reply.completion.logprobs))
        body = ChatCompletionResponse(id=self._id, created=self._created, model=self.shape.model, choices=[choice],
                                      usage=usage(reply), session_id=self.shape.session_id)
        return body.model_dump(exclude_none=True)

    def chunk(self, delta: DeltaMessage, logprobs: ChatCompletionLogProbs | None = None,
              finish: str | None = None) -> str:
        choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=finish)
        return self._event(ChatCompletionStreamResponse(id=self._id, object="chat.completion.chunk",
                                                        created=self._created, model=self.shape.model,
                                                        choices=[choice]))

    def usage_chunk(self, reply: Reply) -> str:
        return self._event(ChatCompletionStreamResponse(id=self._id, object="chat.completion.chunk",
                                                        created=self._created, model=self.shape.model, choices=[],
                                                        usage=usage(reply)))

    def logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> ChatCompletionLogProbs | None:
        if not self.shape.logprobs:
            return None
        return ChatCompletionLogProbs(content=[
            ChatCompletionLogProbsContent(token=text, logprob=logprob, top_logprobs=[])
            for text, logprob in zip(self._token_texts(token_ids), logprobs)])

    @staticmethod
    def _event(chunk: ChatCompletionStreamResponse) -> str:
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


class TextSteps:
    """The text each step of a streamed reply adds, decoding a window of its tokens (TGI's and vLLM's
    incremental detokenization: linear in the reply's length, where decoding the whole reply at every
    step is quadratic). The window keeps a step of context before the unsent tokens, so the tokenizer
    decides spaces at the join as the whole decode does. A byte-level tokenizer ends a character split
    across tokens with U+FFFD until its last byte arrives: such text waits."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.tokens = 0  # tokens whose text has been handed out
        self.text = ""  # the text handed out
        self._anchor = 0  # first token of the decoding window

    def step(self, token_ids: Sequence[int]) -> str | None:
        """The text `token_ids` (the reply so far) add, or None while it must wait."""
        before = self._decode(token_ids[self._anchor:self.tokens])
        window = self._decode(token_ids[self._anchor:])
        if window.endswith(UNFINISHED_CHARACTER) or not window.startswith(before):
            return None
        self._anchor, self.tokens = self.tokens, len(token_ids)
        self.text += window[len(before):]
        return window[len(before):]

    def rest(self, whole: str, token_count: int) -> str:
        """The text of the whole reply not handed out yet ("" when the windows decoded otherwise, warned)."""
        self.tokens = token_count
        if not whole.startswith(self.text):
            log.warning("a streamed reply's text differs from its whole decode: the client must send the "
                        "reply back as recorded (%r), not as streamed (%r)", whole, self.text)
            return ""
        rest, self.text = whole[len(self.text):], whole
        return rest


class StreamedReply:
    """Writes one turn to the client as it is sampled; the session records the turn only once `done`
    has written the whole reply (a client that left earlier can resend the same request)."""

    def __init__(self, request: web.Request, reply_format: ReplyFormat, decode: Callable[[Sequence[int]], str]) -> None:
        self._request = request
        self._format = reply_format
        self._text = TextSteps(decode)  # what the client has been sent of the content
        self._response: web.StreamResponse | None = None

    @property
    def response(self) -> web.StreamResponse:
        """What the handler returns: the stream once started (a client gone before it gets an empty 499)."""
        return self._response or web.Response(status=CLIENT_GONE)

    async def progress(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """The tokens sampled so far: send the text they add (held back while a character is unfinished)."""
        await self._start()
        sent = self._text.tokens
        if self._format.shape.holds_back_content or len(token_ids) == sent:
            return
        text = self._text.step(token_ids)
        if text is not None:
            await self._send_content(text, token_ids[sent:], logprobs[sent:])

    async def done(self, reply: Reply) -> None:
        """The whole reply: the rest of its content (or its tool calls), the finish reason, usage, [DONE]."""
        await self._start()
        completion = reply.completion
        if reply.tool_calls:
            delta = DeltaMessage(content=reply.content, tool_calls=[
                DeltaToolCall(index=index, id=call.id, type="function",
                              function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
                for index, call in enumerate(reply.tool_calls)])
            await self._write(self._format.chunk(delta, self._format.logprobs(completion.token_ids, completion.logprobs)))
        elif len(completion.token_ids) > self._text.tokens or self._text.text != reply.text:
            sent = self._text.tokens
            rest = self._text.rest(reply.text, len(completion.token_ids))
            await self._send_content(rest, completion.token_ids[sent:], completion.logprobs[sent:])
        await self._write(self._format.chunk(DeltaMessage(), finish=finish_reason(reply)))
        if self._format.shape.include_usage:
            await self._write(self._format.usage_chunk(reply))
        await self._write("data: [DONE]\n\n")
        await self._response.write_eof()

    async def _send_content(self, text: str, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Send `text` as the content of `token_ids`, with their log-probs when asked."""
        await self._write(self._format.chunk(DeltaMessage(content=text), self._format.logprobs(token_ids, logprobs)))

    async def _start(self) -> None:
        if self._response is not None:
            return
        self._response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await self._response.prepare(self._request)
        await self._write(self._format.chunk(DeltaMessage(role="assistant", content="")))

    async def _write(self, event: str) -> None:
        await self._response.write(event.encode())


def finish_reason(reply: Reply) -> str:
    return TOOL_CALLS if reply.tool_calls else reply.completion.finish_reason


def usage(reply: Reply) -> UsageInfo:
    generated = len(reply.completion.token_ids)
    return UsageInfo(prompt_tokens=reply.prompt_tokens, completion_tokens=generated,
                     total_tokens=reply.prompt_tokens + generated)
