"""Chat sessions a server can no longer serve, and why, so that their client hears it (HTTP 410 naming the
reason) instead of an unknown-session error or a conversation silently started afresh.

Sessions live in the server's memory. One is lost when it is dropped as idle (`rollout.chat.session_idle_s`)
or when the server process ends with it open: the ids of the open sessions are kept in a file of the
server's state directory, so the next process of the same server knows them as lost by a restart.
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path
from typing import Iterable

from asyncrl.whole_files import write_json_whole

log = logging.getLogger(__name__)

REMEMBERED = 65_536  # lost session ids kept (oldest forgotten first): a bound on memory, far above max_sessions
RESTARTED = ("the rollout server restarted, and open sessions live in its memory; what the session sent is "
             "not trained on")


class LostSessions:
    def __init__(self, open_ids_file: Path | None) -> None:
        """`open_ids_file`: where the open sessions' ids are kept across restarts (None: in memory only)."""
        self._reasons: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._file = open_ids_file
        self.refused = 0  # requests answered 410 for a lost session since the server started
        if open_ids_file is not None and open_ids_file.exists():
            previous = json.loads(open_ids_file.read_text())
            for session_id in previous:
                self.remember(session_id, RESTARTED)
            if previous:
                log.warning("%d chat session(s) open when this server last stopped are lost; their clients get "
                            "HTTP 410", len(previous))
        self.save_open([])

    def remember(self, session_id: str, reason: str) -> None:
        self._reasons[session_id] = reason
        self._reasons.move_to_end(session_id)
        while len(self._reasons) > REMEMBERED:
            self._reasons.popitem(last=False)

    def why(self, session_id: str) -> str | None:
        """Why `session_id` is lost, counting the request that asked; None if it is not."""
        reason = self._reasons.get(session_id)
        if reason is not None:
            self.refused += 1
        return reason

    def save_open(self, session_ids: Iterable[str]) -> None:
        """Record the open sessions (written whole, then renamed: a crash leaves the old list or the new)."""
        if self._file is None:
            return
        write_json_whole(self._file, sorted(session_ids))
