"""Reading and writing prompt files: parquet (verl's primary format) and JSONL with the same fields."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable

from asyncrl.data.rows import DataError, PromptRow, parse_row

log = logging.getLogger(__name__)

MAX_REPORTED_ERRORS = 5  # bad rows listed in one error message before "and N more"


def load_prompt_file(path: str | Path, skip_bad_rows: bool = False) -> list[PromptRow]:
    """All rows of a parquet or JSONL file, validated; a bad row raises (or is skipped and counted)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    rows, errors = [], []
    for index, raw in enumerate(_raw_rows(path)):
        try:
            if isinstance(raw, DataError):
                raise raw
            rows.append(parse_row(raw, str(path), index))
        except DataError as error:
            errors.append(str(error))
    if errors and not skip_bad_rows:
        more = f"\n  ... and {len(errors) - MAX_REPORTED_ERRORS} more" if len(errors) > MAX_REPORTED_ERRORS else ""
        raise DataError("malformed rows:\n  " + "\n  ".join(errors[:MAX_REPORTED_ERRORS]) + more)
    if errors:
        log.warning("skipped %d malformed rows of %s (first: %s)", len(errors), path, errors[0])
    if not rows:
        raise DataError(f"data file {path} holds no usable rows")
    return rows


def write_rows(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write raw verl-layout rows as parquet or JSONL, chosen by the file suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix in (".jsonl", ".json"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        raise DataError(f"cannot write {path}: use a .parquet or .jsonl suffix")
    return path


def _raw_rows(path: Path) -> Iterable[Any]:
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_rows(path)
    raise DataError(f"data file {path}: unsupported suffix '{path.suffix}' (use .parquet or .jsonl)")


def _parquet_rows(path: Path) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as error:  # pyarrow raises several types for a corrupt file
        raise DataError(f"data file {path} is not readable parquet: {error}") from error


def _jsonl_rows(path: Path) -> Iterable[Any]:
    """Parsed objects, or a DataError in place of a line that is not JSON (blank lines are not rows)."""
    with path.open() as handle:
        lines = [line for line in handle if line.strip()]
    for index, line in enumerate(lines):
        try:
            yield json.loads(line)
        except json.JSONDecodeError as error:
            yield DataError(f"{path}, row {index}: not valid JSON ({error.msg})")
