"""A server's numbered prompt stream that survives the server: restarted, it regenerates exactly the
prompts its previous process drew and never got acknowledged, then continues where that one stopped.

Prompt `k` is the k-th prompt the server draws from its mixture; its group's record id is derived from
(server id, k), so a group sent twice is stored once by the buffer (idempotent on record ids). The
state file in the run directory holds the mixture's position before the lowest unacknowledged prompt
(the watermark), the prompts acknowledged above it, and how many were drawn. It is rewritten
atomically on every draw and acknowledgement, so a kill at any point leaves a consistent file; the
only window is a kill between the buffer's acknowledgement and the rewrite, and then the regenerated
group is the duplicate the buffer drops.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from asyncrl.data import PromptMixture, PromptRow
from asyncrl.whole_files import write_json_whole

log = logging.getLogger(__name__)

_T = TypeVar("_T")
Draw = Callable[[Iterator[PromptRow]], _T]  # takes what one prompt needs from the mixture (skips included)


class PromptStream:
    def __init__(self, mixture: PromptMixture, state_path: Path | None = None) -> None:
        self._mixture = mixture
        self._path = state_path
        self._next = 0  # number of the next prompt to draw
        self._pending: dict[int, dict[str, Any]] = {}  # drawn, unacknowledged: number -> mixture state before it
        self._acknowledged_ahead: set[int] = set()  # acknowledged prompts above the lowest pending one
        self._redo_until = 0  # prompts below this were drawn by the previous process
        if state_path is not None and state_path.is_file():
            self._resume(json.loads(state_path.read_text()))

    @property
    def owed(self) -> int:
        """Prompts the previous process drew (was granted) and never got acknowledged: to regenerate
        without asking admission again, since the buffer counts them as running for this server."""
        return sum(1 for k in range(self._next, self._redo_until) if k not in self._acknowledged_ahead)

    def take(self, draw: Draw) -> tuple[int, _T]:
        """The next prompt's number and `draw`'s result for it; prompts acknowledged before a restart are
        drawn again (so the mixture moves exactly as before) and passed over."""
        while True:
            number, state = self._next, self._mixture.state_dict()
            value = draw(self._mixture)
            self._next += 1
            if number not in self._acknowledged_ahead:
                break
        self._pending[number] = state
        self._save()
        return number, value

    def set_weights(self, weights: list[float]) -> None:
        """Draw the next prompts with these file weights (the learner's task weights); saved with the position."""
        if weights != self._mixture.weights:
            self._mixture.set_weights(weights)
            self._save()

    def acknowledge(self, number: int) -> None:
        """The buffer stored prompt `number`'s group."""
        del self._pending[number]
        self._acknowledged_ahead.add(number)
        self._save()

    def _watermark(self) -> tuple[int, dict[str, Any]]:
        """Lowest unacknowledged prompt number and the mixture state before it."""
        if self._pending:
            lowest = min(self._pending)
            return lowest, self._pending[lowest]
        return self._next, self._mixture.state_dict()

    def _save(self) -> None:
        watermark, mixture_state = self._watermark()
        self._acknowledged_ahead = {k for k in self._acknowledged_ahead if k >= watermark}
        if self._path is None:
            return
        state = {"watermark": watermark, "mixture": mixture_state, "drawn": max(self._next, self._redo_until),
                 "acknowledged": sorted(self._acknowledged_ahead)}
        write_json_whole(self._path, state)  # a kill leaves the old file or the new one

    def _resume(self, state: dict[str, Any]) -> None:
        self._mixture.load_state_dict(state["mixture"])
        self._next, self._redo_until = state["watermark"], state["drawn"]
        self._acknowledged_ahead = set(state["acknowledged"])
        log.info("resuming the prompt stream at prompt %d: %d drawn before the restart were not acknowledged",
                 self._next, self.owed)
