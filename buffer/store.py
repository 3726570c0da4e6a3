"""The buffer's state without the network: log, record-id index, pending window, commit point.

Every operation here is what the service does for one message; tests drive it directly. Appended
records reach consumers only once they are durable: `ingest` appends and fsyncs in one call; `write`
leaves the fsync to the caller (the service runs it on a thread) and `publish` makes them visible after.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from asyncrl.config.buffer import BufferConfig
from buffer.group_summary import GroupSummary, record_id_of, summarize_group
from asyncrl.messages import DecodeError
from buffer.commits import CommitPoint, load_commit, save_commit
from buffer.consumers import ConsumerWindows
from buffer.log import LogCorruption, Payload, SegmentLog
from buffer.window import BatchLimits, Entry, PendingWindow, Selection

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class OffsetError(ValueError):
    """A consumer asked for a position the buffer cannot serve (released, or past the end)."""


@dataclass(frozen=True)
class Stored:
    """What the store did with one ingested record."""

    offset: int  # log offset (-1 when not stored)
    duplicate: bool = False  # already in the log: acknowledged, not stored again
    full: bool = False  # not stored: a budget is full, the producer should retry later


@dataclass
class WriteAwaitingFsync:
    """One `write` call's records: in the log, not yet fsynced, not yet visible to consumers."""

    mark: tuple[int, int]  # log end before them: where a failed fsync cuts the log back to
    entries: list[Entry]  # the new records
    ids: dict[str, int]  # their record ids -> offsets
    acks: list[Any] = field(default_factory=list)  # the caller's replies, sent once the records are durable

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)


class TrajectoryStore:
    def __init__(self, config: BufferConfig, directory: Path) -> None:
        self.config = config
        self.directory = directory
        self.log = SegmentLog(directory, config.segment_bytes, config.fsync)
        self.committed = load_commit(directory)
        if self.committed.offset > self.log.end_offset:
            log.warning("committed offset %d is past the log end %d (log lost its tail): resuming at the end",
                        self.committed.offset, self.log.end_offset)
            self.committed = replace(self.committed, offset=self.log.end_offset, ahead=[], dropped_ahead=[])
        self.log.release_before(self.committed.offset)
        self.ids: dict[str, int] = {}  # record id -> offset, for records still in the log
        self._ids_in_order: deque[tuple[int, str]] = deque()
        # offsets at or past the commit dropped as stale
        self._drops_since_commit: set[int] = set(self.committed.dropped_ahead)
        self.awaiting_fsync: deque[WriteAwaitingFsync] = deque()  # written, waiting for their fsync, oldest first
        self._awaiting_fsync_ids: dict[str, int] = {}
        self.consumers = ConsumerWindows(PendingWindow(self.committed.offset, self.committed.ahead), config.max_consumers)
        self.position_rereads = 0  # pending windows read back from the log for a consumer that moved its position
        self._rebuild_from_log()

    # ------------------------------------------------------------------------------------------
    # Positions

    @property
    def window(self) -> PendingWindow:
        """The read position of the consumer served now (`use`)."""
        return self.consumers.current

    def use(self, consumer: bytes) -> None:
        """Serve `consumer` (a client identity) from now on: its own read position."""
        self.consumers.select(consumer)

    @property
    def end_offset(self) -> int:
        """Offset after the last durable record (records still waiting for their fsync lie beyond it)."""
        return self.window.end_offset

    @property
    def dropped_total(self) -> int:
        return self.committed.dropped_before + len(self._drops_since_commit)

    @property
    def accepted(self) -> int:
        """Groups stored for training: every append minus those dropped as stale."""
        return self.end_offset - self.dropped_total

    # ------------------------------------------------------------------------------------------
    # Ingest

    def ingest(self, records: list[tuple[GroupSummary, Payload]]) -> list[Stored]:
        """Append the new records in one log write (and one fsync under the batch policy) and publish them.

        Raises OSError when the log cannot be written; nothing of the call is stored then."""
        results, _ = self.write(records, defer_fsync=False)
        self.publish(len(self.awaiting_fsync))
        return results

    def write(self, records: list[tuple[GroupSummary, Payload]],
              defer_fsync: bool) -> tuple[list[Stored], WriteAwaitingFsync]:
        """Append the new records in one log write; with defer_fsync=True the batch policy's fsync is the caller's.

        The records stay invisible to consumers (but known as duplicates) until `publish`. Raises OSError
        when the log cannot be written; nothing of the call is stored then."""
        results: list[Stored] = []
        staged: dict[str, int] = {}
        frames: list[Payload] = []
        entries: list[Entry] = []
        staged_bytes = 0
        memory_used = self.consumers.learner.bytes + sum(written.nbytes for written in self.awaiting_fsync)
        disk_used = self.log.disk_bytes
        for summary, frame in records:
            known = self._offset_of(summary.record_id, staged)
            if known is not None:
                results.append(Stored(known, duplicate=True))
                continue
            if self._full(memory_used + staged_bytes, disk_used + staged_bytes, len(frame)):
                results.append(Stored(-1, full=True))
                continue
            offset = self.log.end_offset + len(frames)
            staged[summary.record_id] = offset
            frames.append(frame)
            entries.append(_entry(offset, summary, frame))
            staged_bytes += len(frame)
            results.append(Stored(offset))
        written = WriteAwaitingFsync(self.log.mark(), entries, staged)
        if frames:
            self.log.append(frames, defer_fsync=defer_fsync)
        self.awaiting_fsync.append(written)
        self._awaiting_fsync_ids.update(staged)
        return results, written

    def publish(self, count: int) -> list[WriteAwaitingFsync]:
        """The oldest `count` writes are durable: hand their records to consumers; return them."""
        published = [self.awaiting_fsync.popleft() for _ in range(count)]
        for written in published:
            for record_id, offset in written.ids.items():
                del self._awaiting_fsync_ids[record_id]
                self._remember(record_id, offset)
            for entry in written.entries:
                for window in self.consumers:
                    window.append(entry)
        return published

    def discard_awaiting_fsync(self) -> list[WriteAwaitingFsync]:
        """Their fsync failed: cut every record awaiting it out of the log; return the writes dropped."""
        dropped = list(self.awaiting_fsync)
        if dropped:
            self.log.cut_back(dropped[0].mark)
        self.awaiting_fsync.clear()
        self._awaiting_fsync_ids.clear()
        return dropped

    def _offset_of(self, record_id: str, staged: dict[str, int]) -> int | None:
        """Offset of a record already in the log (durable or not) or staged in this write; None if new."""
        for known in (self.ids, self._awaiting_fsync_ids, staged):
            if record_id in known:
                return known[record_id]
        return None

    def _full(self, memory_used: int, disk_used: int, frame_bytes: int) -> bool:
        """The record would overrun a budget. An empty budget takes any one record, so every record fits."""
        memory_full = memory_used > 0 and memory_used + frame_bytes > self.config.max_memory_bytes
        disk_full = disk_used > 0 and disk_used + frame_bytes > self.config.max_disk_bytes
        return memory_full or disk_full

    def _remember(self, record_id: str, offset: int) -> None:
        self.ids[record_id] = offset
        self._ids_in_order.append((offset, record_id))

    # ------------------------------------------------------------------------------------------
    # Consumption

    def seek(self, offset: int, ahead: Sequence[int] = ()) -> None:
        """Put the read position where the consumer is: every record before `offset` and those in `ahead`
        consumed (-1 = leave it where it is). Records consumed since are handed out again."""
        if offset < 0 or (offset, sorted(ahead)) == self.window.position():
            return
        self._check_position(offset, ahead)
        uncommitted = [o for o in self.committed.ahead if o >= offset and o not in ahead]
        if uncommitted:
            raise OffsetError(f"records {uncommitted[:5]} are committed but not consumed at offset {offset}: "
                              "a position older than the commit")
        window = PendingWindow(offset, ahead)
        for entry in self._entries_from_log(offset, self.end_offset):
            window.append(entry)
        self.consumers.replace_current(window)
        self.position_rereads += 1

    def frames(self, entries: list[Entry]) -> list[bytes]:
        """The records' bytes, read back from the log (checksums checked)."""
        return [self.log.read(entry.offset) for entry in entries]

    def take(self, limits: BatchLimits) -> Selection:
        selection = self.window.take(limits)
        self._drops_since_commit.update(entry.offset for entry in selection.dropped)
        self._drops_since_commit.difference_update(entry.offset for entry in selection.taken)
        return selection

    def commit(self, offset: int, policy_version: int, ahead: Sequence[int] = ()) -> None:
        """Persist the consumer's commit, then delete the segments it releases."""
        if offset < self.committed.offset:
            raise OffsetError(f"commit of offset {offset} is before the committed offset {self.committed.offset}")
        self._check_position(offset, ahead, subject="commit of offset")
        self.window.consume_through(offset, ahead)  # handed out before a buffer restart
        for window in self.consumers:  # the log before the commit goes: no other consumer can read it either
            window.consume_through(offset, ())
        self.consumers.current_commits()
        released_drops = {o for o in self._drops_since_commit if o < offset}
        self._drops_since_commit -= released_drops
        dropped_ahead = sorted(self._drops_since_commit.intersection(ahead))
        self.committed = CommitPoint(offset, policy_version, self.committed.dropped_before + len(released_drops),
                                     ahead=sorted(ahead), dropped_ahead=dropped_ahead)
        save_commit(self.directory, self.committed)
        first = self.log.release_before(offset)
        while self._ids_in_order and self._ids_in_order[0][0] < first:
            del self.ids[self._ids_in_order.popleft()[1]]

    def _check_position(self, offset: int, ahead: Sequence[int], subject: str = "offset") -> None:
        first = max(self.committed.offset, self.log.first_offset)
        if not first <= offset <= self.end_offset:
            raise OffsetError(f"{subject} {offset} is outside the servable range [{first}, {self.end_offset}]")
        outside = [o for o in ahead if not offset <= o < self.end_offset]
        if outside:
            raise OffsetError(f"consumed offsets {outside[:5]} lie outside [{offset}, {self.end_offset}) (offset, end)")

    # ------------------------------------------------------------------------------------------
    # Recovery

    def _rebuild_from_log(self) -> None:
        """Rebuild the id index from every retained record and the window from the committed offset."""
        for offset, frame in self.log.read_range(self.log.first_offset, self.window.read_offset):
            self._remember(_checked(offset, record_id_of, frame), offset)
        for offset, summary, frame in self._summaries_from_log(self.window.read_offset, self.log.end_offset):
            self._remember(summary.record_id, offset)
            self.window.append(_entry(offset, summary, frame))
        log.info("buffer state: committed %d, end %d, %d group(s) waiting", self.committed.offset,
                 self.end_offset, len(self.window))

    def _summaries_from_log(self, start: int, stop: int) -> Iterator[tuple[int, GroupSummary, bytes]]:
        for offset, frame in self.log.read_range(start, stop):
            yield offset, _checked(offset, summarize_group, frame), frame

    def _entries_from_log(self, start: int, stop: int) -> Iterator[Entry]:
        return (_entry(*record) for record in self._summaries_from_log(start, stop))

    def close(self) -> None:
        self.log.close()


def _entry(offset: int, summary: GroupSummary, frame: Payload) -> Entry:
    return Entry(offset, len(frame), summary.num_samples, summary.num_tokens, summary.response_tokens,
                 summary.oldest_version, summary.learner_version_at_start)


def _checked(offset: int, parse: Callable[[bytes], _T], frame: bytes) -> _T:
    """Parse a stored record; a record that passed its checksum yet does not decode is corruption."""
    try:
        return parse(frame)
    except DecodeError as error:
        raise LogCorruption(f"record {offset} does not decode: {error}") from error
