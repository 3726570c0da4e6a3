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
    """Samples and response tokens of the groups stored, by the version each started under, so that what the
    learner was handed can be compared with as many generated samples taken in the order the buffer hands them
    out (oldest start first, then as stored): it reads the same lengths unless groups were dropped, or an old
    group is still waiting while younger ones went out. Groups still generating count on neither side.

    Memory stays bounded in a job of days: a start version whose groups were all taken, with every older one, is
    folded into one running total (`settled`) and forgets its groups. The count asked for only grows (samples
    handed out), so a later answer takes a folded version whole again; a group stored late under a folded version
    joins the total, ahead of every open version, as the buffer would hand it out."""

    groups: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # open start version -> (samples, response tokens) per group, as stored
    settled: tuple[int, int] = (0, 0)  # samples and response tokens of the folded versions' groups
    settled_through: int | None = None  # newest folded start version; None: none folded yet

    def add(self, start_version: int, samples: int, response_tokens: int) -> None:
        """A group stored (start version -1: it has no trained token)."""
        if self.settled_through is not None and start_version <= self.settled_through:
            self.settled = (self.settled[0] + samples, self.settled[1] + response_tokens)
        else:
            self.groups.setdefault(start_version, []).append((samples, response_tokens))

    def first(self, samples: int) -> tuple[int, int]:
        """(samples, response tokens) of the first whole groups in hand-out order that hold at least `samples`
        samples (all of them while fewer were stored; all folded ones when late groups made those more than
        `samples`). `samples` must not shrink from one call to the next: versions taken whole are folded."""
        taken, tokens = self.settled
        for version in sorted(self.groups):
            if taken >= samples:
                break
            version_samples = sum(group_samples for group_samples, _ in self.groups[version])
            if taken + version_samples > samples:  # the count ends inside this version: its groups one by one
                return _first_groups(self.groups[version], samples, taken, tokens)
            taken += version_samples
            tokens += sum(group_tokens for _, group_tokens in self.groups.pop(version))
            self.settled, self.settled_through = (taken, tokens), version
        return taken, tokens


def _first_groups(groups: list[tuple[int, int]], samples: int, taken: int, tokens: int) -> tuple[int, int]:
    """`taken` samples and `tokens` so far, plus `groups` in order until at least `samples` samples are taken."""
    for group_samples, group_tokens in groups:
        if taken >= samples:
            break
        taken, tokens = taken + group_samples, tokens + group_tokens
    return taken, tokens


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
