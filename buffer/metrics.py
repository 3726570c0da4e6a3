"""Counters of the buffer service, its ingest rate over a sliding window, and the generated work by the version
each group started under."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class IngestRate:
    window_s: float  # rates cover appends within this many seconds
    samples: deque[tuple[float, int, int]] = field(default_factory=deque)  # (time, groups, bytes) per append

    def add(self, now: float, groups: int, nbytes: int) -> None:
        self.samples.append((now, groups, nbytes))
        self._trim(now)

    def rates(self, now: float) -> tuple[float, float]:
        """Groups/s and bytes/s over the window."""
        self._trim(now)
        groups = sum(sample[1] for sample in self.samples)
        nbytes = sum(sample[2] for sample in self.samples)
        return groups / self.window_s, nbytes / self.window_s

    def _trim(self, now: float) -> None:
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()


@dataclass
class GeneratedByStart:
    """Samples and response tokens generated, counted in the order the buffer hands groups out (oldest start
    version first, then as stored), as many as the learner was handed: the generated side of
    `response_length/trained_vs_generated`. At each hand-out the groups stored and not yet counted are taken in
    that order until the count reaches the samples handed out so far, so it reads the learner's own lengths
    unless the buffer dropped groups (they count here in the place they held) or something cut what was
    trained. Groups still generating count on neither side; a group stored late, under an old version, counts
    at the next hand-out, as the buffer hands it out then.

    Only the groups not yet counted are kept, so memory stays bounded in a job of days."""

    pending: dict[int, deque[tuple[int, int]]] = field(default_factory=dict)  # start version -> (samples, response tokens) per group not yet counted, as stored
    taken: tuple[int, int] = (0, 0)  # samples and response tokens of the groups counted so far

    def add(self, start_version: int, samples: int, response_tokens: int) -> None:
        """A group stored (start version -1: it has no trained token)."""
        self.pending.setdefault(start_version, deque()).append((samples, response_tokens))

    def hand_out(self, handed_out_samples: int) -> None:
        """Count whole groups, oldest start first, until the count holds `handed_out_samples` samples (the
        running total handed out) or none is left."""
        samples, tokens = self.taken
        while samples < handed_out_samples and self.pending:
            version = min(self.pending)
            group_samples, group_tokens = self.pending[version].popleft()
            samples, tokens = samples + group_samples, tokens + group_tokens
            if not self.pending[version]:
                del self.pending[version]
        self.taken = (samples, tokens)


@dataclass
class Counters:
    ingested: int = 0  # groups appended
    ingested_samples: int = 0  # their samples
    ingested_response_tokens: int = 0  # their trained completion tokens (loss mask 1)
    duplicates: int = 0  # resends acknowledged without storing
    handed_out: int = 0  # groups handed out in batches
    handed_out_samples: int = 0  # their samples
    handed_out_response_tokens: int = 0  # their trained completion tokens
    dropped_stale: int = 0  # groups dropped at read time: they started outside the staleness bound
    dropped_stale_response_tokens: int = 0  # their trained completion tokens: generated work thrown away
    rejected_frames: int = 0  # undecodable or oversized frames
    full_rejections: int = 0  # ingests told to retry later (budget full)
    refused_requests: int = 0  # well-formed requests refused (a bad position, a client over its caps)
    refused_over_caps: int = 0  # of those, refused by a cap (its parked requests, its wait, admission leases)
    unparked: int = 0  # batch requests answered at once, not parked, because the total parking caps were full
    staleness: Counter = field(default_factory=Counter)  # staleness -> groups handed out with it
