"""A flag set by SIGTERM or SIGINT, for supervising loops that must stop their children cleanly."""

from __future__ import annotations

import signal


class StopSignal:
    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum: int, frame: object) -> None:
        self.requested = True
