"""What the buffer's counters say of the generated training work the learner trains: the trained/generated mean
response length and the work thrown away, by hand."""

from __future__ import annotations

import pytest

from asyncrl.messages import BufferStats
from learner.services.generated_work import generated_work_metrics


def stats(**counts: int) -> BufferStats:
    return BufferStats(size=0, size_bytes=0, log_bytes=0, read_offset=0, committed_offset=0, end_offset=0,
                       policy_version=0, ingested=0, duplicates=0, ingest_groups_per_s=0.0, ingest_bytes_per_s=0.0,
                       handed_out=0, dropped_stale=0, staleness_histogram={}, rejected_frames=0, full_rejections=0,
                       admission_running=0, admission_waits=0, admission_wait_s=0.0, admission_released=0, **counts)


def test_length_bias_reads_as_the_trained_mean_length_over_that_of_as_many_samples_generated():
    # 40 samples stored, 12,000 response tokens; 32 handed out with 8,000 (mean 250), while the first 32 stored by
    # start version held 9,600 (mean 300): long ones were dropped, or left behind while younger ones went out
    metrics = generated_work_metrics(stats(ingested_samples=40, ingested_response_tokens=12_000, handed_out_samples=32,
                                           handed_out_response_tokens=8_000, first_generated_samples=32,
                                           first_generated_response_tokens=9_600, dropped_stale_response_tokens=600))
    assert metrics["response_length/generated_mean"] == 300.0
    assert metrics["response_length/trained_vs_generated"] == pytest.approx(250 / 300)
    assert (metrics["work/thrown_away_tokens"], metrics["work/thrown_away_frac"]) == (600.0, 0.05)


def test_work_the_servers_threw_away_counts_beside_the_groups_the_buffer_dropped():
    # 9,000 response tokens stored, 600 of them dropped as stale; 1,000 sampled by the servers and never sent
    metrics = generated_work_metrics(stats(ingested_response_tokens=9_000, dropped_stale_response_tokens=600),
                                     thrown_away_by_servers=1_000)
    assert (metrics["work/thrown_away_tokens"], metrics["work/thrown_away_frac"]) == (1_600.0, 0.16)


def test_before_anything_is_handed_out_only_the_thrown_away_work_is_reported():
    assert generated_work_metrics(stats()) == {"work/thrown_away_tokens": 0.0, "work/thrown_away_frac": 0.0}
    stored_only = generated_work_metrics(stats(ingested_samples=4, ingested_response_tokens=100))
    assert "response_length/trained_vs_generated" not in stored_only
