"""The run directory's weight snapshots (`validation.after_run`): the policy of every version that validation is due
on, kept while the job runs and scored after it by `asyncrl evaluate` on an engine of its own, off the job's clock.

Layout under RUN_DIR/snapshots/: `v<version>.pt` (the served weights as torch.save's list of (name, tensor): a
tied weight is stored once) and `made.jsonl`, one line per snapshot written, {"version", "made_at"}: the Unix
time at which the learner held that version, the moment the race to a score reads. A line is appended only once its
file is complete, so a line always names a whole snapshot. `asyncrl evaluate` writes RUN_DIR/evaluation.jsonl,
one line per version scored: {"version", "made_at", "evaluated_at", val/* metrics}."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SNAPSHOTS_DIR = "snapshots"  # under the run directory
INDEX_FILE = "made.jsonl"  # in SNAPSHOTS_DIR
EVALUATION_FILE = "evaluation.jsonl"  # in the run directory


def snapshot_due(version: int, every: int, final_version: int) -> bool:
    """Validation is due on `version`: a multiple of `every` (version 0 included) or the job's final version."""
    return bool(every) and (version % every == 0 or version == final_version)


def due_versions(every: int, final_version: int) -> list[int]:
    """Every version a job of `final_version` steps validates, in order."""
    return [v for v in range(final_version + 1) if snapshot_due(v, every, final_version)]


def snapshot_path(run_dir: Path, version: int) -> Path:
    return run_dir / SNAPSHOTS_DIR / f"v{version}.pt"


def made_times(run_dir: Path) -> dict[int, float]:
    """Each snapshot's version and the Unix time it was made, from the index; a version made twice (a resumed job
    made it again) counts by its latest line, whose weights its file holds."""
    return {version: record["made_at"] for version, record in _by_version(run_dir / SNAPSHOTS_DIR / INDEX_FILE).items()}


def read_evaluation(run_dir: Path) -> dict[int, dict[str, Any]]:
    """`asyncrl evaluate`'s record of each scored version (the latest, where one was scored twice)."""
    return _by_version(run_dir / EVALUATION_FILE)


def unscored_versions(run_dir: Path) -> tuple[list[int], list[int]]:
    """The versions made and not scored yet, in order: those whose snapshot file is there to score, and those whose
    file is gone (records restored without their weights, a host given back): those stay unscored for good."""
    scored = read_evaluation(run_dir)
    unscored = [version for version in sorted(made_times(run_dir)) if version not in scored]
    there = [version for version in unscored if snapshot_path(run_dir, version).is_file()]
    return there, [version for version in unscored if version not in there]


def _by_version(path: Path) -> dict[int, dict[str, Any]]:
    """A JSON-lines file's records by their "version", the latest line of a version winning; {} without the file."""
    lines = path.read_text().splitlines() if path.is_file() else []
    return {record["version"]: record for record in map(json.loads, lines)}
