"""Which policy versions the tokens of a trajectory group may carry, judged when the buffer takes the group in.

Every token carries the version whose weights sampled it; the learner makes every version, and the servers sample
only with weights it sent them. So a group is refused at ingest (a bug or a hostile producer, never a slow one) when
a token's version is
- below -1: -1 marks a token without a version, and nothing else below 0 is a version;
- past the newest learner version the buffer has heard plus `VERSION_LEAD`: the learner sends new weights to the
  servers before it tells the buffer their version, and it tells the buffer every version it reaches before it takes
  the next batch, so the servers are at most one version ahead of what the buffer heard.
A group let in with such a version would pass as fresh (or as a start past the learner's) until read, and then be
dropped as stale at best.

The newest version heard is kept in the buffer's directory: a buffer restarted beside the learner still knows the
versions the servers may hold from before its restart (their groups in flight then arrive first). A buffer that has
heard no version yet judges only the lower bound.
"""

from __future__ import annotations

import os
from pathlib import Path

NO_VERSION = -1  # the version of a token that has none
VERSION_LEAD = 1  # how far the servers' weights can be ahead of the newest learner version the buffer heard
HEARD_FILE = "newest_version"  # in the buffer directory: the newest learner version heard, as decimal text


class HeardVersion:
    """The newest learner version this buffer directory has heard (requests, commits, published versions)."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / HEARD_FILE
        self.newest = int(self._path.read_text()) if self._path.exists() else None  # None: none heard yet

    def hear(self, version: int) -> None:
        if self.newest is not None and version <= self.newest:
            return
        self.newest = version
        # replaced atomically, not fsynced: a restart after the buffer process dies reads it back from the page
        # cache, and the learner's step does not wait for the disk
        temporary = self._path.with_name(HEARD_FILE + ".tmp")
        temporary.write_text(str(version))
        os.replace(temporary, self._path)

    def refusal(self, lowest: int, highest: int) -> str:
        """Why a group whose token versions span `lowest`..`highest` is refused, naming the field; "" if it is not."""
        if lowest < NO_VERSION:
            return (f"token_versions holds {lowest}: no policy version is below 0, and {NO_VERSION} marks a token "
                    "without one")
        if self.newest is not None and highest > self.newest + VERSION_LEAD:
            return (f"token_versions holds {highest}, past the learner's newest version {self.newest} + {VERSION_LEAD}: "
                    "servers sample only with weights the learner sent")
        return ""
