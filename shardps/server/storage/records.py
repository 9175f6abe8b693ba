"""Rows of the disk tier as RocksDB sees them: keys (a row's hash slot, then its id, big-endian: a slot's rows are
one key range) and fixed-size records (``RecordCodec``: values, optimizer state, step count and metadata)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shardps.core.routing import slot_of_ids

KEY = np.dtype([("slot", ">u2"), ("id", ">u8")])
_KEY_VOID = np.dtype(f"V{KEY.itemsize}")
META_FIELDS = (("steps", "<i4"), ("last_version", "<i8"), ("last_time", "<u4"), ("touches", "<i4"))


def encode_keys(ids: np.ndarray) -> list[bytes]:
    """The keys of ``ids`` (int64), one bytes object each."""
    rec = np.empty(ids.shape[0], KEY)
    rec["slot"] = slot_of_ids(ids)
    rec["id"] = ids.view(np.uint64)
    return rec.view(_KEY_VOID).tolist()  # type: ignore[no-any-return]


def decode_keys(keys: Sequence[bytes]) -> np.ndarray:
    """The ids of ``keys`` (int64)."""
    if not keys:
        return np.zeros(0, np.int64)
    return np.frombuffer(b"".join(keys), KEY)["id"].astype(np.int64)


def slot_range(first: int, last: int) -> tuple[bytes, bytes]:
    """The keys bounding slots [first, last]: every key of those slots is >= the first and < the second."""
    return first.to_bytes(2, "big"), (last + 1).to_bytes(2, "big")


class RecordCodec:
    """A table's rows as fixed-size records: values, one array per optimizer state name, then the step count and
    the metadata (last push's version and time, pushes), little-endian and packed."""

    def __init__(self, dim: int, state_names: Sequence[str]) -> None:
        self.dim = dim
        self.state_names = list(state_names)
        self.dtype = np.dtype([("rows", "<f4", (dim,))] + [("state." + n, "<f4", (dim,)) for n in self.state_names]
                              + list(META_FIELDS))
        self._void = np.dtype(f"V{self.dtype.itemsize}")

    def describe(self) -> dict[str, Any]:
        return {"dim": self.dim, "state": self.state_names, "record_bytes": self.dtype.itemsize}

    def encode(self, fields: dict[str, np.ndarray]) -> list[bytes]:
        """One record per row of ``fields`` (``rows``, ``state.<name>``, ``steps`` and the metadata)."""
        n = fields["rows"].shape[0]
        rec = np.empty(n, self.dtype)
        for name in self.dtype.names or ():
            rec[name] = fields[name]
        return rec.view(self._void).tolist()  # type: ignore[no-any-return]

    def decode(self, values: Sequence[bytes]) -> np.ndarray:
        """The records ``values`` (all present) as one structured array (a view of their concatenation)."""
        if not values:
            return np.zeros(0, self.dtype)
        return np.frombuffer(b"".join(values), self.dtype)
