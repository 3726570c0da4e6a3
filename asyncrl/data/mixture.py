"""Weighted mixing of several prompt files (multi-task training), with a checkpointable position.

Each draw picks a file with probability proportional to its weight, then that file's next row in a
seeded per-epoch order. The whole position, with the weights, is a small dict, saved with the learner's
checkpoint. The weights may change while drawing (dynamic task weights).
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from asyncrl.data.readers import load_prompt_file
from asyncrl.data.rows import PromptRow
from asyncrl.rng import rng_state_from_json, rng_state_to_json


class PromptMixture:
    def __init__(
        self,
        files: Sequence[str],
        weights: Sequence[float] = (),
        seed: int = 0,
        shuffle: bool = True,
        skip_bad_rows: bool = False,
    ) -> None:
        self.files = list(files)
        self.sources = [load_prompt_file(path, skip_bad_rows) for path in self.files]
        self.weights: list[float] = []
        self.set_weights(list(weights) or [1.0] * len(self.files))
        self.seed = seed
        self.shuffle = shuffle
        self._picker = random.Random(seed)
        self._epoch = [0] * len(self.files)
        self._cursor = [0] * len(self.files)
        self._orders = [self._order(index) for index in range(len(self.files))]

    def __iter__(self) -> "PromptMixture":
        return self

    def __next__(self) -> PromptRow:
        index = self._picker.choices(range(len(self.files)), weights=self.weights)[0]
        if self._cursor[index] == len(self.sources[index]):
            self._epoch[index] += 1
            self._cursor[index] = 0
            self._orders[index] = self._order(index)
        row = self.sources[index][self._orders[index][self._cursor[index]]]
        self._cursor[index] += 1
        return row

    def set_weights(self, weights: Sequence[float]) -> None:
        """Draw the next files with these weights (one per file, non-negative, positive sum)."""
        if len(weights) != len(self.files) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"mixture weights {list(weights)}: need {len(self.files)} non-negative weights with a positive sum")
        self.weights = [float(w) for w in weights]

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream: restoring it continues with exactly the rows that would have come next."""
        return {
            "files": list(self.files),
            "weights": list(self.weights),
            "picker": rng_state_to_json(self._picker.getstate()),
            "epoch": list(self._epoch),
            "cursor": list(self._cursor),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["files"] != self.files:
            raise ValueError(f"data state was saved for files {state['files']}, not {self.files}")
        if "weights" in state:  # saved since the weights can change; older states drew with the configured ones
            self.set_weights(state["weights"])
        self._picker.setstate(rng_state_from_json(state["picker"]))
        self._epoch = list(state["epoch"])
        self._cursor = list(state["cursor"])
        self._orders = [self._order(index) for index in range(len(self.files))]

    def _order(self, index: int) -> list[int]:
        order = list(range(len(self.sources[index])))
        if self.shuffle:
            random.Random(f"{self.seed}/{index}/{self._epoch[index]}").shuffle(order)
        return order

