"""The one metrics sink: every record goes to `metrics.jsonl` in the run directory and to wandb
(offline when no API key is configured, so nothing is lost on an air-gapped machine).

In wandb each record is a row of its own, and each metric is charted against its own step metric: `val/*` against
`val/version` (the version a pass validated), everything else against `step`. Rows keyed by the learner's step would
merge the records of one step, and a step's validation passes beyond its newest would be lost there."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

from asyncrl.config.sections import MetricsConfig
from asyncrl.validation_scores import PREFIX, VERSION_KEY

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
STEP_TIME_KEY = "timing_s/step"  # in every record of a learner step; not in a validation pass's record of its own
STEP_KEY = "step"  # policy version after the step: the x-axis of every metric but validation's


class MetricsLogger:
    def __init__(self, run_dir: str | Path, settings: MetricsConfig, run_config: Mapping[str, Any] | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._wandb = _start_wandb(Path(run_dir), settings, run_config or {})
        self._charted: set[str] = set()  # metrics given their x-axis in wandb so far

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record `values` at `step`; non-finite numbers are kept in jsonl as null and skipped by wandb."""
        record = {STEP_KEY: step, "time": time.time(), **{k: _finite_or_none(v) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            row = {k: v for k, v in record.items() if v is not None and k != "time"}
            self._chart_new_metrics(row)
            self._wandb.log(row)  # no step=: one row per record, its x-axes set by _chart_new_metrics

    def _chart_new_metrics(self, row: Mapping[str, Any]) -> None:
        """Give each metric not seen before its x-axis (exact names: wandb matches overlapping globs in no set order)."""
        for key in row.keys() - self._charted - {STEP_KEY, VERSION_KEY}:
            axis = VERSION_KEY if key.startswith(PREFIX + "/") else STEP_KEY
            self._wandb.define_metric(key, step_metric=axis)
            self._charted.add(key)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run, in order (a torn last line from a killed run is ignored)."""
    records = []
    for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping an unreadable metrics line in %s", run_dir)
    return records


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the learner's steps, in order: one per step, without the records of their own that validation
    passes get when several arrive for one step (each pass's `val/*` and `val/version`, at that step)."""
    return [record for record in records if STEP_TIME_KEY in record]


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _start_wandb(run_dir: Path, settings: MetricsConfig, run_config: Mapping[str, Any]) -> Any:
    mode = settings.wandb_mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if mode == "disabled":
        return None
    import wandb

    return wandb.init(
        project=settings.wandb_project,
        entity=settings.wandb_entity or None,
        name=run_dir.name,
        dir=str(run_dir),
        mode=mode,
        config=dict(run_config),
        settings=wandb.Settings(silent=True),
    )
