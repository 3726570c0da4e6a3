"""fsync on the helper thread: one at a time, its end readable on a file descriptor, its error handed back."""

from __future__ import annotations

import os
import select

import pytest

from buffer.background_fsync import BackgroundFsync

WAIT_S = 5


def finished(background: BackgroundFsync) -> bool:
    return bool(select.select([background.fileno()], [], [], WAIT_S)[0])


def test_an_fsync_runs_off_thread_and_reports_its_end(tmp_path):
    background = BackgroundFsync()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"data")
    background.start(os.dup(fd))
    with pytest.raises(RuntimeError, match="already running"):
        background.start(fd)
    assert finished(background) and background.finish() is None and not background.busy
    os.close(fd)
    background.close()


def test_a_failed_fsync_hands_back_its_error(tmp_path, monkeypatch):
    background = BackgroundFsync()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error")))
    background.start(os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT))
    assert finished(background)
    error = background.finish()
    assert isinstance(error, OSError) and error.errno == 5
    background.close()
