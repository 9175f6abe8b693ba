"""Rows of the disk tier as fixed-size records (``RecordCodec``: values, optimizer state, step count and metadata), and
the copies of record columns to and from per-row arrays (``gather_columns``, ``scatter_columns``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shardps.core import kernels

META_FIELDS = (("steps", "<i4"), ("last_version", "<i8"), ("last_time", "<u4"), ("touches", "<i4"))

# A column: (a per-row array as 4-byte words, [rows, words], the column's first word in its rows, its width in words,
# its first word in a record). Every field of a record and of a table's per-row arrays is a whole number of words at
# a whole number of words from the start.
Column = tuple[np.ndarray, int, int, int]


class RecordCodec:
    """A table's rows as fixed-size records: values, one array per optimizer state name, then the step count and
    the metadata (last push's version and time, pushes), little-endian and packed."""

    def __init__(self, dim: int, state_names: Sequence[str]) -> None:
        self.dim = dim
        self.state_names = list(state_names)
        self.dtype = np.dtype([("rows", "<f4", (dim,))] + [("state." + n, "<f4", (dim,)) for n in self.state_names]
                              + list(META_FIELDS))

    def describe(self) -> dict[str, Any]:
        return {"dim": self.dim, "state": self.state_names, "record_bytes": self.dtype.itemsize}

    def pack(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        """One record per row of ``fields`` (``rows``, ``state.<name>``, ``steps`` and the metadata)."""
        rec = np.empty(fields["rows"].shape[0], self.dtype)
        for name in self.dtype.names or ():
            rec[name] = fields[name]
        return rec

    def word(self, name: str) -> int:
        """The first 4-byte word of field ``name`` in a record."""
        return int(self.dtype.fields[name][1]) // 4  # type: ignore[index]


def as_words(arr: np.ndarray) -> np.ndarray:
    """A C-ordered per-row array (1-D, 2-D or of records) as its 4-byte words, one row of them per row."""
    return arr.view(np.uint32).reshape(arr.shape[0], arr[:1].nbytes // 4)


def gather_columns(out: np.ndarray, columns: Sequence[Column], slots: np.ndarray) -> None:
    """``out[i, at:at + width] = src[slots[i], first:first + width]`` for each column ``(src, first, width, at)``:
    the rows of ``slots`` into records (``out``: uint32 words, a row per record), one compiled pass a column
    (``kernels``' ``gather_words``) where numpy's gather then copy made two."""
    k = kernels.jit()
    for src, first, width, at in columns:
        if k is not None:
            k.gather_words(src, first, width, slots, out, at)
        else:
            out[:, at:at + width] = src[slots, first:first + width]


def scatter_columns(records: np.ndarray, columns: Sequence[Column], slots: np.ndarray) -> None:
    """``dst[slots[i], first:first + width] = records[i, at:at + width]`` for each column ``(dst, first, width, at)``:
    records (uint32 words, a row each) into the per-row arrays at ``slots``."""
    k = kernels.jit()
    for dst, first, width, at in columns:
        if k is not None:
            k.scatter_words(dst, first, width, slots, records, at)
        else:
            dst[slots, first:first + width] = records[:, at:at + width]
