"""Rows of the disk tier as fixed-size records (``RecordCodec``: values, optimizer state, step count and metadata)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

META_FIELDS = (("steps", "<i4"), ("last_version", "<i8"), ("last_time", "<u4"), ("touches", "<i4"))


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
