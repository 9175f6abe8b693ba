"""A collection's layout: which feature reads which table, how tables of one width and pooling share a local
weight, how (table, id) pairs pack into one int64; and one forward's plan (``Step``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def _pooling(p: Any) -> str:
    """"sum", "mean" or "none" of a PoolingType (ours or TorchRec's) or a string."""
    name = str(getattr(p, "name", p)).lower()
    if name not in ("sum", "mean", "none"):
        raise ValueError(f"pooling must be SUM, MEAN or NONE, got {p!r}")
    return name


class Layout:
    """Which feature reads which table, and how tables group into shared local weights (equal width and
    pooling, contiguous in the collection's table order)."""

    def __init__(self, configs: list[Any], pooled: bool) -> None:
        names = [c.name for c in configs]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"every table needs a name of its own, got {names}")
        features = [f for c in configs for f in c.feature_names]
        if len(set(features)) != len(features):
            raise ValueError(f"a feature may read one table only, got {features}")
        if not features:
            raise ValueError("a collection needs at least one feature")
        self.pools = [_pooling(c.pooling) if pooled else "none" for c in configs]
        if pooled and "none" in self.pools:
            raise ValueError("an embedding bag collection pools its bags: SUM or MEAN")
        # Tables in group order (equal (dim, pooling) adjacent), so each group's unique rows are contiguous.
        order = sorted(range(len(configs)), key=lambda i: (configs[i].embedding_dim, self.pools[i], i))
        self.configs = [configs[i] for i in order]
        self.pools = [self.pools[i] for i in order]
        self.tables = [c.name for c in self.configs]
        self.dims = np.array([c.embedding_dim for c in self.configs], dtype=np.int64)
        self.rows = np.array([c.num_embeddings for c in self.configs], dtype=np.int64)
        self.features = features  # in config order: the output's keys
        self.table_of = {f: order.index(i) for i, c in enumerate(configs) for f in c.feature_names}
        self.feature_dims = [int(self.dims[self.table_of[f]]) for f in features]  # the output's column widths
        self.feature_starts = np.concatenate([[0], np.cumsum(self.feature_dims)]).astype(np.int64)
        keys = [(c.embedding_dim, p) for c, p in zip(self.configs, self.pools)]
        self.groups: list[tuple[int, int]] = []  # [first table, end table) per group
        for t, k in enumerate(keys):
            if t and keys[t - 1] == k:
                self.groups[-1] = (self.groups[-1][0], t + 1)
            else:
                self.groups.append((t, t + 1))
        self.group_of_table = np.zeros(len(self.tables), dtype=np.int64)
        for g, (a, b) in enumerate(self.groups):
            self.group_of_table[a:b] = g
        # Packing (table, id) into one int64: table t's ids start at base[t] (ids are checked in range first).
        self.base = np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)
        if self.rows.sum() >= 2**62:
            raise ValueError("the tables of one collection hold at most 2^62 rows in all")


@dataclass
class Step:
    """One forward's plan: per table its unique ids, per value its row in its group's local weight."""

    uniq: list[np.ndarray]  # per table (layout order), sorted unique ids
    local: np.ndarray  # per value (input order): row in its group's weight
    group_of_value: np.ndarray
    feature_pos: dict[str, int]  # feature -> its index among the input's keys
    lengths: np.ndarray  # [keys, stride] bag lengths
    stride: int
