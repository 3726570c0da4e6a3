"""How much of the servers' generated training work the learner trains, read from the buffer's counters (since
the buffer started): the mean response length trained against that of as many generated samples, taken in the
order the buffer hands them out (oldest start first, the groups it dropped as stale counted in their place), 1
without length bias; and the work thrown away, by the buffer and by the servers, 0 in a normal run (docs/metrics.md).

The generated side is not every sample stored: at any moment the buffer holds up to K + 1 batches not yet
trained, the recent groups whose short responses finished first while their long ones still generate, and
comparing with all of them would read the pipeline's content as a length bias."""

from __future__ import annotations

from asyncrl.messages import BufferStats


def generated_work_metrics(stats: BufferStats, thrown_away_by_servers: int = 0) -> dict[str, float]:
    """`response_length/generated_mean`, `response_length/trained_vs_generated` (once the buffer has handed out
    samples it stored) and `work/thrown_away_tokens`, `work/thrown_away_frac`: the groups the buffer dropped and
    `thrown_away_by_servers`, the tokens the servers sampled and never sent (groups cut short by a server's stop,
    chat sessions dropped), over all that was generated."""
    thrown_away = stats.dropped_stale_response_tokens + thrown_away_by_servers
    generated = stats.ingested_response_tokens + thrown_away_by_servers
    metrics = {"work/thrown_away_tokens": float(thrown_away),
               "work/thrown_away_frac": thrown_away / generated if generated else 0.0}
    if stats.handed_out_samples and stats.first_generated_samples and stats.first_generated_response_tokens:
        generated = stats.first_generated_response_tokens / stats.first_generated_samples
        trained = stats.handed_out_response_tokens / stats.handed_out_samples
        metrics |= {"response_length/generated_mean": generated,
                    "response_length/trained_vs_generated": trained / generated}
    return metrics
