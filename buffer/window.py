"""The records the consumer has not consumed yet, summarised in memory, and batch selection.

An entry holds what selection needs (offset, size, samples, tokens, start versions), not the record's
bytes: those are in the log (and the page cache), and are read back when a batch hands them out.

Selection is oldest first: the groups with the oldest tokens go first (log order among equals), so that
a long response, which finishes versions after the groups that started with it, is trained as soon as it
arrives and no fresher group overtakes it. How long a group generated never excludes it: the staleness
rule judges its start (`asyncrl/staleness.py`), so the only groups dropped (whole, and counted) are those
that started from weights more than K versions behind the learner of their time, which a server that keeps
the rule never sends. The others are taken whole until the batch is full.

Consumption is therefore not a prefix of the log: the position is `read_offset` (every record before it
consumed) plus `ahead`, the records at or past it consumed too (handed out or dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from asyncrl.staleness import staleness, starts_within_bound


@dataclass(frozen=True)
class Entry:
    offset: int  # position in the log
    nbytes: int  # size of the encoded TrajectoryGroup message (the log holds its bytes)
    num_samples: int  # trajectories in the group
    num_tokens: int  # prompt + completion tokens of the group
    response_tokens: int  # trained completion tokens (loss mask 1) of the group
    oldest_version: int  # oldest trained token version: the version the group started under (-1 if none)
    learner_version_at_start: int  # learner version when the group started (-1: unknown)


@dataclass(frozen=True)
class BatchLimits:
    policy_version: int  # version that will train on the batch (the staleness of what it takes is measured against it)
    max_staleness: int  # K, which a group's start must have kept
    max_samples: int = 0  # 0 = no limit
    max_tokens: int = 0  # 0 = no limit
    max_bytes: int = 0  # encoded groups per batch, so the Batch fits the receiver's frame limit; 0 = no limit

    def full(self, samples: int, tokens: int) -> bool:
        return (0 < self.max_samples <= samples) or (0 < self.max_tokens <= tokens)

    def overflows(self, samples: int, tokens: int, nbytes: int) -> bool:
        return (0 < self.max_samples < samples) or (0 < self.max_tokens < tokens) or (0 < self.max_bytes < nbytes)


@dataclass
class Selection:
    taken: list[Entry] = field(default_factory=list)  # groups for the batch, in log order
    dropped: list[Entry] = field(default_factory=list)  # groups that started outside the bound, dropped
    staleness: list[int] = field(default_factory=list)  # staleness of each taken group
    full: bool = False  # the limits were reached


class PendingWindow:
    """Records [read_offset, end_offset) not consumed yet; `ahead`: the consumed ones in that range."""

    def __init__(self, read_offset: int, ahead: Iterable[int] = ()) -> None:
        self.read_offset = read_offset
        self.end_offset = read_offset
        self.ahead: set[int] = set(ahead)
        self.entries: dict[int, Entry] = {}  # offset -> entry, in log order
        self._by_version: dict[int, dict[int, Entry]] = {}  # oldest version -> its entries, in log order
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def copy(self) -> PendingWindow:
        """An independent window at the same position over the same records (the entries are immutable)."""
        twin = PendingWindow(self.read_offset, self.ahead)
        twin.end_offset, twin.bytes = self.end_offset, self.bytes
        twin.entries = dict(self.entries)
        twin._by_version = {version: dict(bucket) for version, bucket in self._by_version.items()}
        return twin

    def append(self, entry: Entry) -> None:
        """The next record of the log (skipped if the position already counts it as consumed)."""
        if entry.offset != self.end_offset:
            raise ValueError(f"entry at offset {entry.offset} does not follow the window end {self.end_offset}")
        self.end_offset += 1
        if entry.offset not in self.ahead:
            self.entries[entry.offset] = entry
            self._by_version.setdefault(entry.oldest_version, {})[entry.offset] = entry
            self.bytes += entry.nbytes

    def plan(self, limits: BatchLimits) -> Selection:
        """What `take` would hand out now, without consuming anything."""
        selection = Selection()
        chosen: list[tuple[Entry, int]] = []  # (entry, staleness), oldest first
        samples = tokens = nbytes = 0
        for entry in self._oldest_first():
            if not starts_within_bound(entry.learner_version_at_start, entry.oldest_version, limits.max_staleness):
                selection.dropped.append(entry)
                continue
            lag = staleness(limits.policy_version, entry.oldest_version)
            grown = (samples + entry.num_samples, tokens + entry.num_tokens, nbytes + entry.nbytes)
            if chosen and limits.overflows(*grown):
                selection.full = True
                break
            chosen.append((entry, lag))
            samples, tokens, nbytes = grown
            if limits.full(samples, tokens):
                selection.full = True
                break
        chosen.sort(key=lambda pair: pair[0].offset)
        selection.taken, selection.staleness = [entry for entry, _ in chosen], [lag for _, lag in chosen]
        selection.dropped.sort(key=lambda entry: entry.offset)
        return selection

    def take(self, limits: BatchLimits) -> Selection:
        """Hand out the planned groups and drop those that started outside the bound: both count as consumed."""
        selection = self.plan(limits)
        self.consume(entry.offset for entry in selection.taken + selection.dropped)
        return selection

    def consume(self, offsets: Iterable[int]) -> None:
        """Mark these records consumed (those already consumed are ignored) and move `read_offset` past
        the consumed prefix."""
        for offset in offsets:
            entry = self.entries.pop(offset, None)
            if entry is not None:
                self._forget(entry)
                self.ahead.add(offset)
        while self.read_offset in self.ahead:
            self.ahead.remove(self.read_offset)
            self.read_offset += 1

    def consume_through(self, offset: int, ahead: Iterable[int]) -> None:
        """Everything a consumer at (`offset`, `ahead`) has consumed counts as consumed here too."""
        self.consume([*range(self.read_offset, min(offset, self.end_offset)), *ahead])

    def position(self) -> tuple[int, list[int]]:
        """(read_offset, sorted ahead): what a consumer stores and sends back to resume here."""
        return self.read_offset, sorted(self.ahead)

    def _oldest_first(self) -> Iterator[Entry]:
        """Entries by oldest version (untrained groups, -1, first), then log order. The versions present
        are few (about K + 2), so this costs no sort of the entries."""
        for version in sorted(self._by_version):
            yield from self._by_version[version].values()

    def _forget(self, entry: Entry) -> None:
        bucket = self._by_version[entry.oldest_version]
        del bucket[entry.offset]
        if not bucket:
            del self._by_version[entry.oldest_version]
        self.bytes -= entry.nbytes
