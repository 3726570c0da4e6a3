from __future__ import annotations

import os

import pytest

from buffer.log import FORMAT_FILE, LOG_FORMAT, RECORD_HEADER, LogCorruption, SegmentLog

SEGMENT_BYTES = 256


def payloads(count: int, start: int = 0) -> list[bytes]:
    return [f"record-{i}-".encode() * 5 for i in range(start, start + count)]


def test_append_read_across_segments_and_reopen(tmp_path):
    log = SegmentLog(tmp_path, SEGMENT_BYTES, "batch")
    assert log.append(payloads(10)) == 0
    assert log.append(payloads(15, start=10)) == 10
    assert len(log.segments) > 2
    log.close()
    reopened = SegmentLog(tmp_path, SEGMENT_BYTES, "batch")
    assert (reopened.first_offset, reopened.end_offset) == (0, 25)
    assert [payload for _, payload in reopened.read_range(0, 25)] == payloads(25)
    assert reopened.append(payloads(1, start=25)) == 25


@pytest.mark.parametrize("damage", ["half_header", "half_payload", "flipped_byte"])
def test_recovery_truncates_a_torn_tail(tmp_path, damage):
    log = SegmentLog(tmp_path, 1 << 20, "batch")
    log.append(payloads(5))
    last = log.segments[-1]
    position, size = last.positions[-1], last.size
    log.close()
    with open(last.path, "r+b") as file:
        if damage == "half_header":
            file.truncate(position + RECORD_HEADER.size // 2)
        elif damage == "half_payload":
            file.truncate(size - 3)
        else:
            file.seek(size - 1)
            byte = file.read(1)
            file.seek(size - 1)
            file.write(bytes([byte[0] ^ 0xFF]))

    recovered = SegmentLog(tmp_path, 1 << 20, "batch")

    assert recovered.end_offset == 4
    assert os.path.getsize(last.path) == position
    assert [p for _, p in recovered.read_range(0, 4)] == payloads(4)
    assert recovered.append([b"after"]) == 4
    assert recovered.read(4) == b"after"


def test_garbage_after_the_last_record_is_cut(tmp_path):
    log = SegmentLog(tmp_path, 1 << 20, "none")
    log.append(payloads(3))
    log.close()
    with open(log.segments[-1].path, "ab") as file:
        file.write(os.urandom(100))
    assert SegmentLog(tmp_path, 1 << 20, "none").end_offset == 3


def test_damage_in_a_closed_segment_is_corruption_not_a_torn_tail(tmp_path):
    log = SegmentLog(tmp_path, SEGMENT_BYTES, "batch")
    log.append(payloads(20))
    first = log.segments[0]
    log.close()
    with open(first.path, "r+b") as file:
        file.seek(RECORD_HEADER.size)
        file.write(b"X")
    with pytest.raises(LogCorruption):
        SegmentLog(tmp_path, SEGMENT_BYTES, "batch")


def test_retention_deletes_only_whole_segments_below_the_offset(tmp_path):
    log = SegmentLog(tmp_path, SEGMENT_BYTES, "batch")
    log.append(payloads(30))
    boundaries = [(segment.base, segment.end) for segment in log.segments]
    cut = boundaries[1][0] + 1  # inside the second segment
    assert log.release_before(cut) == boundaries[1][0]
    assert log.read(cut) == payloads(30)[cut]
    with pytest.raises(IndexError):
        log.read(boundaries[0][0])
    assert log.release_before(10**9) == log.segments[-1].base  # the segment being written stays
    assert len(log.segments) == 1
    log.close()
    assert SegmentLog(tmp_path, SEGMENT_BYTES, "batch").first_offset == log.segments[-1].base


@pytest.mark.parametrize("policy, expected", [("always", 6), ("batch", 2), ("none", 0)])
def test_fsync_policy(tmp_path, monkeypatch, policy, expected):
    log = SegmentLog(tmp_path, 1 << 20, policy)
    calls = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd))
    log.append(payloads(3))
    log.append(payloads(3, start=3))
    assert len(calls) == expected


def test_a_failed_write_leaves_no_partial_record(tmp_path, monkeypatch):
    log = SegmentLog(tmp_path, 1 << 20, "batch")
    log.append(payloads(2))
    real_writev = os.writev

    def write_some_then_fail(fd, buffers):
        real_writev(fd, [buffers[0], bytes(buffers[1][:3])])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", write_some_then_fail)
    with pytest.raises(OSError):
        log.append(payloads(2, start=2))
    monkeypatch.setattr(os, "writev", real_writev)
    assert log.end_offset == 2
    assert log.append([b"next"]) == 2
    log.close()
    assert [p for _, p in SegmentLog(tmp_path, 1 << 20, "batch").read_range(0, 3)] == payloads(2) + [b"next"]


def test_a_failure_after_a_segment_roll_undoes_the_whole_append(tmp_path, monkeypatch):
    log = SegmentLog(tmp_path, SEGMENT_BYTES, "batch")
    log.append(payloads(2))
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(OSError):
        log.append(payloads(20, start=2))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert (log.end_offset, len(log.segments)) == (2, 1)
    log.close()
    assert SegmentLog(tmp_path, SEGMENT_BYTES, "batch").end_offset == 2


def test_short_vectored_writes_are_completed(tmp_path, monkeypatch):
    real_writev = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, buffers: real_writev(fd, [bytes(buffers[0][:5])]))
    log = SegmentLog(tmp_path, 1 << 20, "batch")
    log.append(payloads(3))
    monkeypatch.setattr(os, "writev", real_writev)
    log.close()
    assert [p for _, p in SegmentLog(tmp_path, 1 << 20, "batch").read_range(0, 3)] == payloads(3)


def test_a_log_of_another_format_is_refused_not_truncated(tmp_path):
    SegmentLog(tmp_path, 1 << 20, "batch").append(payloads(2))
    (tmp_path / FORMAT_FILE).unlink()  # what a log written before format 2 looks like
    with pytest.raises(LogCorruption, match="format 1"):
        SegmentLog(tmp_path, 1 << 20, "batch")
    (tmp_path / FORMAT_FILE).write_text("9")
    with pytest.raises(LogCorruption, match="format 9"):
        SegmentLog(tmp_path, 1 << 20, "batch")
    (tmp_path / FORMAT_FILE).write_text(LOG_FORMAT)
    assert SegmentLog(tmp_path, 1 << 20, "batch").end_offset == 2
