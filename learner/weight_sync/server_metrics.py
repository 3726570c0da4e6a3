"""Per-server rollout metrics from the servers' telemetry counters: rates over the interval between a
server's last two reports (measured on its own uptime clock) and each server's version lag."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.weight_transfer.control_messages import ServerTelemetry


@dataclass(frozen=True)
class _Reading:
    tokens: int  # tokens_generated at the reading
    idle_s: float  # idle_seconds at the reading
    uptime_s: float  # uptime_seconds at the reading


class ServerMetrics:
    def __init__(self) -> None:
        self._previous: dict[str, _Reading] = {}
        self._rates_seen: dict[str, tuple[float, float]] = {}  # each server's rates at its latest new report
        self._thrown_away: dict[str, tuple[float, int]] = {}  # each server's latest (uptime, thrown_away_tokens)
        self._thrown_away_before = 0  # the last counts of server processes that restarted since

    def metrics(self, beats: list[ServerTelemetry], versions: dict[str, int], learner_version: int) -> dict[str, float]:
        """`rollout/<server_id>/{tokens_per_s,idle_ratio,inflight,version_lag}` for each server's telemetry, plus
        `rollout/tokens_per_s` and `rollout/inflight` (sums) and `rollout/version_lag/{mean,max}` over them. `versions` holds the
        version each server is known to hold (heartbeat or last successful round), else its telemetry's."""
        values: dict[str, float] = {}
        lags = []
        for beat in beats:
            lag = max(learner_version - versions.get(beat.server_id, beat.version), 0)
            lags.append(lag)
            tokens_per_s, idle_ratio = self._rates(beat)
            prefix = f"rollout/{beat.server_id}"
            values |= {f"{prefix}/tokens_per_s": tokens_per_s, f"{prefix}/idle_ratio": idle_ratio,
                       f"{prefix}/inflight": float(beat.inflight), f"{prefix}/version_lag": float(lag)}
        if beats:
            values |= {"rollout/tokens_per_s": sum(values[f"rollout/{b.server_id}/tokens_per_s"] for b in beats),
                       "rollout/inflight": float(sum(b.inflight for b in beats)),
                       "rollout/version_lag/mean": sum(lags) / len(lags), "rollout/version_lag/max": float(max(lags))}
        return values

    def thrown_away_tokens(self, beats: list[ServerTelemetry]) -> int:
        """Tokens the servers sampled for training and threw away, since the learner started: each server's latest
        count, heard however long ago (a server that stopped reported its last), plus the last count of each of its
        processes that restarted since (a restarted server counts from 0 again)."""
        for beat in beats:
            before = self._thrown_away.get(beat.server_id)
            if before is not None and beat.uptime_seconds < before[0]:
                self._thrown_away_before += before[1]
            self._thrown_away[beat.server_id] = (beat.uptime_seconds, beat.thrown_away_tokens)
        return self._thrown_away_before + sum(count for _, count in self._thrown_away.values())

    def _rates(self, beat: ServerTelemetry) -> tuple[float, float]:
        """Tokens/s and idle share between this server's last two reports (since its start after a restart).
        A report read again (the learner steps faster than servers report) keeps its rates, not 0."""
        now = _Reading(beat.tokens_generated, beat.idle_seconds, beat.uptime_seconds)
        before = self._previous.get(beat.server_id)
        if before == now and beat.server_id in self._rates_seen:
            return self._rates_seen[beat.server_id]
        if before is None or now.uptime_s < before.uptime_s:  # first reading, or the server restarted
            before = _Reading(0, 0.0, 0.0)
        self._previous[beat.server_id] = now
        elapsed = now.uptime_s - before.uptime_s
        rates = ((now.tokens - before.tokens) / elapsed, (now.idle_s - before.idle_s) / elapsed) if elapsed > 0 else (0.0, 0.0)
        self._rates_seen[beat.server_id] = rates
        return rates
