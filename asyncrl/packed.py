"""Per-token fields on the wire: packed little-endian arrays (msgpack bin), not msgpack lists of numbers.

A 1,024-token trajectory as msgpack lists is some 4,000 numbers that a receiver parses one by one into
Python objects; packed, it is five byte strings, checked by their lengths and, for the loss mask, one
scan in C. In memory the fields stay Python lists (what rollout servers build and the learner reads);
the list types below only tell the codec how each field travels. `decode` turns them back into lists
(`as_lists`); the buffer's ingest check only counts their items (`packed_count`, the same checks).
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np


class PackedList(list):
    """A list carried on the wire as one packed array of `dtype`; `allowed` restricts its byte values."""

    dtype: ClassVar[np.dtype]
    allowed: ClassVar[bytes | None] = None  # for one-byte dtypes: the only byte values a valid array holds


class Int32List(PackedList):
    dtype = np.dtype("<i4")


class Float32List(PackedList):
    dtype = np.dtype("<f4")


class MaskList(PackedList):
    dtype = np.dtype("u1")
    allowed = b"\x00\x01"


def pack(values: Sequence[float] | np.ndarray, kind: type[PackedList]) -> bytes:
    """The packed bytes of `values`; ValueError when a value does not fit the field's type."""
    try:
        with np.errstate(over="raise", invalid="raise"):  # a float beyond float32's range is an error, not inf
            array = np.asarray(values, dtype=kind.dtype)
    except (ArithmeticError, ValueError, TypeError) as error:
        raise ValueError(f"cannot pack as {kind.dtype.str}: {error}") from None
    data = array.tobytes()
    _check_values(data, kind)
    return data


def packed_count(data: Any, kind: type[PackedList]) -> int:
    """Items in received packed bytes; TypeError/ValueError when they are not a valid array of `kind`."""
    if not isinstance(data, (bytes, memoryview)):
        raise TypeError(f"expected a packed {kind.dtype.str} array (msgpack bin), got {type(data).__name__}")
    if len(data) % kind.dtype.itemsize:
        raise ValueError(f"packed {kind.dtype.str} array of {len(data)} bytes is not a whole number of "
                         f"{kind.dtype.itemsize}-byte items")
    _check_values(data, kind)
    return len(data) // kind.dtype.itemsize


def checked_array(data: Any, kind: type[PackedList]) -> np.ndarray:
    """A read-only numpy view of received packed bytes, after the checks of `packed_count`."""
    packed_count(data, kind)
    return np.frombuffer(data, dtype=kind.dtype)


def _check_values(data: bytes | memoryview, kind: type[PackedList]) -> None:
    if kind.allowed is not None and bytes(data).translate(None, kind.allowed):
        raise ValueError(f"packed {kind.dtype.str} array holds values other than {list(kind.allowed)}")


def as_lists(annotation: type, obj: Any) -> Any:
    """msgspec `dec_hook`: a checked packed array, decoded into its list type."""
    if isinstance(annotation, type) and issubclass(annotation, PackedList):
        return annotation(checked_array(obj, annotation).tolist())
    raise TypeError(f"no decoder for {annotation}")
