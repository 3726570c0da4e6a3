"""The committed position, kept durably in the buffer directory (atomic replace, fsynced)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from buffer.log import fsync_directory

COMMIT_FILE = "committed.json"


@dataclass(frozen=True)
class CommitPoint:
    offset: int = 0  # every record below it is trained on and checkpointed by the learner
    policy_version: int = 0  # learner version at the commit
    dropped_before: int = 0  # records below `offset` dropped as stale (admission counts accepted = stored − dropped)
    ahead: list[int] = field(default_factory=list)  # records at or past `offset` consumed too (handed out or dropped)
    dropped_ahead: list[int] = field(default_factory=list)  # those of `ahead` dropped as stale


def load_commit(directory: Path) -> CommitPoint:
    path = directory / COMMIT_FILE
    if not path.exists():
        return CommitPoint()
    return CommitPoint(**json.loads(path.read_text()))


def save_commit(directory: Path, point: CommitPoint) -> None:
    """Write through a temporary file and rename, so a crash leaves the old or the new point, never half."""
    temporary = directory / (COMMIT_FILE + ".tmp")
    with open(temporary, "w") as file:
        json.dump(asdict(point), file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, directory / COMMIT_FILE)
    fsync_directory(directory)
