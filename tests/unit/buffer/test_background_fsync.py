"""fsync on the helper thread: one at a time, its end readable on a file descriptor, its error handed back."""

from __future__ import annotations

import os
import select

import pytest

from buffer.background_fsync import BackgroundFsync

WAIT_S = 5


def finished(syncer: BackgroundFsync) -> bool:
    return bool(select.select([syncer.fileno()], [], [], WAIT_S)[0])


def test_a_sync_runs_off_thread_and_reports_its_end(tmp_path):
    syncer = BackgroundFsync()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"data")
    syncer.start(os.dup(fd))
    with pytest.raises(RuntimeError, match="already running"):
        syncer.start(fd)
    assert finished(syncer) and syncer.finish() is None and not syncer.busy
    os.close(fd)
    syncer.close()


def test_a_failed_sync_hands_back_its_error(tmp_path, monkeypatch):
    syncer = BackgroundFsync()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error")))
    syncer.start(os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT))
    assert finished(syncer)
    error = syncer.finish()
    assert isinstance(error, OSError) and error.errno == 5
    syncer.close()
