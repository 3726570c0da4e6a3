"""The study setting `buffer.study_lag_versions` = L: the servers sample with the learner's weights of L
versions ago, so that every sample trained at version v came from π_{v−L} while the learner's proximal policy
is π_v. The learner keeps the full weights of the last L + 1 versions (copies in CPU memory) and, at each
broadcast, sends the oldest of them as the version it is, so the servers stamp their tokens with the version
that really sampled them."""

from __future__ import annotations

from collections import deque

from asyncrl.weight_transfer.protocol import NamedTensors


class LaggedWeights:
    """Full weights of the versions at most `lag` behind the newest one given."""

    def __init__(self, lag: int) -> None:
        if lag < 1:
            raise ValueError(f"a weight lag must be at least 1 version (got {lag})")
        self.lag = lag
        self._kept: deque[tuple[int, NamedTensors]] = deque()  # (version, weights), oldest first

    def lagged(self, version: int, weights: NamedTensors) -> tuple[int, NamedTensors]:
        """Keep `weights` as `version`; return the oldest kept version no more than `lag` behind it, with its
        weights: `version − lag` once that many versions were given (before, at a start or resume, the first)."""
        self._kept.append((version, weights))
        while self._kept[0][0] < version - self.lag:
            self._kept.popleft()
        return self._kept[0]

