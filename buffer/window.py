"""The records from the read cursor to the end of the log, summarised in memory, and batch selection.

An entry holds what selection needs (offset, size, samples, tokens, oldest version), not the record's
bytes: those are in the log (and the page cache), and are read back when a batch hands them out.

Selection walks from the cursor in log order. A group whose staleness (judged now, for the requesting
learner's version) exceeds the bound is dropped whole; the others are taken whole until the batch is
full. Everything the walk passes is consumed: the batch's next_offset lies after it.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from asyncrl.staleness import staleness


@dataclass(frozen=True)
class Entry:
    offset: int  # position in the log
    nbytes: int  # size of the encoded TrajectoryGroup message (the log holds its bytes)
    num_samples: int  # trajectories in the group
    num_tokens: int  # prompt + completion tokens of the group
    oldest_version: int  # oldest trained token version (-1 if none)


@dataclass(frozen=True)
class BatchLimits:
    policy_version: int  # version that will train on the batch
    max_staleness: int  # K
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
    dropped: list[Entry] = field(default_factory=list)  # groups too stale, dropped
    staleness: list[int] = field(default_factory=list)  # staleness of each taken group
    consumed: int = 0  # records walked past from the cursor (taken + dropped)
    full: bool = False  # the limits were reached


class PendingWindow:
    """Contiguous records [read_offset, end): what the buffer has not yet handed out."""

    def __init__(self, read_offset: int) -> None:
        self.read_offset = read_offset
        self.entries: deque[Entry] = deque()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def end_offset(self) -> int:
        return self.read_offset + len(self.entries)

    def append(self, entry: Entry) -> None:
        if entry.offset != self.end_offset:
            raise ValueError(f"entry at offset {entry.offset} does not follow the window end {self.end_offset}")
        self.entries.append(entry)
        self.bytes += entry.nbytes

    def plan(self, limits: BatchLimits) -> Selection:
        """What `take` would hand out now, without consuming anything."""
        selection = Selection()
        samples = tokens = nbytes = 0
        for entry in self.entries:
            lag = staleness(limits.policy_version, entry.oldest_version)
            if lag > limits.max_staleness:
                selection.dropped.append(entry)
                selection.consumed += 1
                continue
            grown = (samples + entry.num_samples, tokens + entry.num_tokens, nbytes + entry.nbytes)
            if selection.taken and limits.overflows(*grown):
                selection.full = True
                break
            selection.taken.append(entry)
            selection.staleness.append(lag)
            selection.consumed += 1
            samples, tokens, nbytes = grown
            if limits.full(samples, tokens):
                selection.full = True
                break
        return selection

    def take(self, limits: BatchLimits) -> Selection:
        """Hand out the planned groups and drop the stale ones: the cursor moves past both."""
        selection = self.plan(limits)
        self.skip(selection.consumed)
        return selection

    def skip(self, count: int) -> None:
        for _ in range(count):
            self.bytes -= self.entries.popleft().nbytes
        self.read_offset += count

    def rewind(self, offset: int, earlier: Iterable[Entry]) -> None:
        """Move the cursor back to `offset`; `earlier` are the records [offset, read_offset) in order."""
        restored = list(itertools.islice(earlier, self.read_offset - offset))
        if len(restored) != self.read_offset - offset:
            raise ValueError(f"rewind to {offset} needs {self.read_offset - offset} records, got {len(restored)}")
        self.entries.extendleft(reversed(restored))
        self.bytes += sum(entry.nbytes for entry in restored)
        self.read_offset = offset
