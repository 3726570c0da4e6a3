"""How much of the servers' generated training work the learner trains, read from the buffer's counters (since
the buffer started): the mean response length trained against the mean generated, 1 without length bias, and
the work thrown away, 0 in a normal run (docs/metrics.md)."""

from __future__ import annotations

from asyncrl.messages import BufferStats


def generated_work_metrics(stats: BufferStats) -> dict[str, float]:
    """`response_length/generated_mean`, `response_length/trained_vs_generated` (once the buffer has stored and
    handed out samples) and `work/thrown_away_tokens`, `work/thrown_away_frac`."""
    thrown_away = stats.dropped_stale_response_tokens
    metrics = {"work/thrown_away_tokens": float(thrown_away),
               "work/thrown_away_frac": thrown_away / stats.ingested_response_tokens if stats.ingested_response_tokens else 0.0}
    if stats.ingested_samples and stats.handed_out_samples and stats.ingested_response_tokens:
        generated = stats.ingested_response_tokens / stats.ingested_samples
        trained = stats.handed_out_response_tokens / stats.handed_out_samples
        metrics |= {"response_length/generated_mean": generated, "response_length/trained_vs_generated": trained / generated}
    return metrics
