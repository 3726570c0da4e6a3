"""One sampled completion and the accumulator that builds it from vLLM's outputs (the final output alone
where vLLM reports exact version spans, else streamed deltas tagged on arrival)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_servers import vllm_compat


@dataclass
class Completion:
    """What the engine sampled for one request, token by token."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # completion tokens, in order
    logprobs: list[float]  # behaviour log-prob of each sampled token
    versions: list[int]  # policy version whose weights sampled each token
    finish_reason: str  # "stop", "length", "abort"

    def version_counts(self) -> dict[int, int]:
        """Tokens per policy version (a request that spanned updates has several)."""
        counts: dict[int, int] = {}
        for version in self.versions:
            counts[version] = counts.get(version, 0) + 1
        return counts


@dataclass
class TokenStream:
    """Accumulates the outputs of one request; tags each token with the version current on arrival, which
    the engine's exact spans replace where vLLM reports them."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    exact_spans: list[tuple[int, int, int]] | None = None  # from the engine, when vLLM reports them

    def absorb(self, output: Any, current_version: int) -> None:
        """Append one RequestOutput: a delta, or the final output (a single completion: n = 1 per request)."""
        (delta,) = output.outputs
        new_tokens = list(delta.token_ids)
        self.token_ids += new_tokens
        self.logprobs += vllm_compat.sampled_logprobs(delta.logprobs, new_tokens)
        self.versions += [current_version] * len(new_tokens)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.exact_spans = vllm_compat.version_spans(delta)

    def completion(self) -> Completion:
        if len(self.logprobs) != len(self.token_ids):
            raise RuntimeError(
                f"request {self.request_id}: {len(self.logprobs)} log-probs for {len(self.token_ids)} tokens"
            )
        return Completion(
            self.request_id, self.prompt_ids, self.token_ids, self.logprobs, self._final_versions(), self.finish_reason
        )

    def _final_versions(self) -> list[int]:
        """The engine's exact spans where available; the arrival tags otherwise."""
        if self.exact_spans is None:
            return self.versions
        versions = [0] * len(self.token_ids)
        for version, start, end in self.exact_spans:
            versions[start:end] = [version] * (end - start)
        return versions
