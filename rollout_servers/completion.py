"""One sampled completion and the accumulator that builds it from vLLM's final output and the policy
versions of its tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from asyncrl.messages import Trajectory
from asyncrl.thinking import Thinking
from rollout_servers import vllm_compat

TokensSoFar = Callable[[Sequence[int], Sequence[float]], Awaitable[None]]  # told the ids and log-probs sampled so far


@dataclass
class Completion:
    """What the engine sampled for one request, token by token."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # completion tokens, in order
    logprobs: list[float]  # behaviour log-prob of each sampled token
    versions: list[int]  # policy version whose weights sampled each token
    finish_reason: str  # "stop", "length" or "abort"

    def trajectory(self, score: float, info: dict[str, float], error: str, group_id: str, data_source: str,
                   thinking: Thinking) -> Trajectory:
        """The completion as a single-turn sample scored `score`, trained but for thinking blocks `thinking` masks."""
        mask, logprobs = thinking.trained(self.token_ids, self.logprobs)
        return Trajectory(prompt_ids=self.prompt_ids, completion_ids=self.token_ids, behaviour_logprobs=logprobs,
                          token_versions=self.versions, loss_mask=mask, reward=score, group_id=group_id,
                          data_source=data_source, finish_reason=self.finish_reason, reward_info=info,
                          reward_error=error)

    def version_counts(self) -> dict[int, int]:
        """Tokens per policy version (a request that spanned updates has several)."""
        counts: dict[int, int] = {}
        for version in self.versions:
            counts[version] = counts.get(version, 0) + 1
        return counts


@dataclass
class TokenStream:
    """One request's final output and the version its tokens were sampled with: vLLM's exact spans where
    it reports them (0.32+), else the boundaries the engine recorded at each weight update (the number of
    tokens sampled when the update paused the engine, read from vLLM's output processor)."""

    request_id: str
    prompt_ids: list[int]
    start_version: int  # the engine's version when the request was submitted
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    engine_spans: bool = True  # whether vLLM's spans are read (an adapter switch is counted by the engine core instead)
    exact_spans: list[tuple[int, int, int]] | None = None  # (version, start, end), from the engine
    boundaries: list[tuple[int, int]] = field(default_factory=list)  # (tokens sampled before, new version)

    def version_changed(self, sampled: int, version: int) -> None:
        """An update to `version` landed after `sampled` tokens of this request (the engine was paused, or the
        engine core counted them at an adapter switch). A request whose final output already arrived sampled every
        token with the old weights."""
        if not self.finish_reason:
            self.boundaries.append((sampled, version))

    def absorb(self, output: Any) -> None:
        """Take the request's final output (a single completion: n = 1 per request)."""
        (final,) = output.outputs
        self.token_ids = list(final.token_ids)
        self.logprobs = vllm_compat.sampled_logprobs(final.logprobs, self.token_ids)
        self.finish_reason = final.finish_reason or ""
        self.exact_spans = vllm_compat.version_spans(final) if self.engine_spans else None

    def completion(self) -> Completion:
        if len(self.logprobs) != len(self.token_ids):
            raise RuntimeError(
                f"request {self.request_id}: {len(self.logprobs)} log-probs for {len(self.token_ids)} tokens"
            )
        return Completion(
            self.request_id, self.prompt_ids, self.token_ids, self.logprobs, self._final_versions(), self.finish_reason
        )

    def _final_versions(self) -> list[int]:
        """The engine's exact spans where available; the recorded update boundaries otherwise."""
        versions = [self.start_version] * len(self.token_ids)
        if self.exact_spans is not None:
            for version, start, end in self.exact_spans:
                versions[start:end] = [version] * (end - start)
            return versions
        for sampled, version in self.boundaries:
            versions[sampled:] = [version] * max(0, len(versions) - sampled)
        return versions
