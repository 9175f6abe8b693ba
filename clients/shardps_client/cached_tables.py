"""Tables served from a trainer-side row cache (``Client.cache_table``), and pushes of table rows.

Every push of a table's rows passes here: rows a cache holds sum their
gradients locally (``shardps_client.cache``), the rest go to the shards.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import numpy as np
import torch

from shardps.core.ids import coalesce
from shardps_client.cache import CacheStats, RowCache
from shardps_client.errors import IdOutOfRangeError, InvalidArgumentError
from shardps_client.inputs import (
    WIRE_INF,
    IdsLike,
    check_grads,
    check_sent,
    checked_ids,
    grads_to_numpy,
    ids_to_numpy,
    names,
)
from shardps_client.session import Session
from shardps_client.versions import Versions

log = logging.getLogger(__name__)


class CachedTables:
    """The row caches of one client's tables, by table name."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._caches: dict[str, RowCache] = {}

    def get(self, table: str) -> Optional[RowCache]:
        """``table``'s row cache, or None."""
        return self._caches.get(table)

    def configure(self, table: str, steps: int, max_rows: int) -> None:
        """Set ``table``'s cache (``Client.cache_table``): what an old one summed is pushed first."""
        spec = self._session.catalog.table(table)
        if not isinstance(steps, int) or steps < 0:
            raise InvalidArgumentError(f"{table}: cache steps must be an int >= 0, got {steps!r}")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise InvalidArgumentError(f"{table}: cache max_rows must be an int >= 1, got {max_rows!r}")
        if spec.sync is not None and steps:
            raise InvalidArgumentError(f"{table}: a synchronous table cannot be cached (every worker pushes every "
                                       "step)")
        old = self._caches.pop(table, None)
        if old is not None:
            self._drain(table, old)
        if steps:
            self._caches[table] = RowCache(spec.dim, steps, max_rows)

    def stats(self, table: str) -> Optional[CacheStats]:
        """Counters of ``table``'s row cache (None when it has none)."""
        cache = self._caches.get(table)
        return None if cache is None else cache.stats

    def drain_all(self) -> None:
        """Push what every cache summed, emptying them (before a flush)."""
        for table, cache in list(self._caches.items()):
            self._drain(table, cache)

    def _drain(self, table: str, cache: RowCache) -> None:
        spec = self._session.catalog.table(table)
        for ids, grads in cache.drain():
            self._session.push_rows(spec, ids, grads, None, False, self._session.wire_dtype)

    def push(self, table: str, ids: IdsLike, grads: Union[torch.Tensor, np.ndarray], versions: Optional[Versions],
             wait: bool, wire_dtype: Optional[str]) -> None:
        """``Client.push``: check, coalesce, let a cache absorb what it holds, push the rest."""
        spec = self._session.catalog.table(table)
        g = grads_to_numpy(grads, f"{table}: grads")  # (converted first: errors in the order they always came)
        ids_np = checked_ids(spec, ids)
        check_grads(g, table, "grads", ids_np.shape + (spec.dim,), "ids.shape + (dim,)", spec.allow_nonfinite)
        uniq, summed = coalesce(ids_np.reshape(-1), g.reshape(-1, spec.dim))
        wire_code = self._session.wire(wire_dtype)  # before the step number: a refused push must not use one up
        check_sent(summed, table, wire_code, spec.allow_nonfinite, summed=uniq.shape[0] != ids_np.size)
        cache = self._caches.get(table)
        if cache is not None:  # rows the cache holds sum their gradients locally
            absorbed = cache.accumulate(uniq, summed)
            if absorbed.all():
                return
            uniq, summed = uniq[~absorbed], summed[~absorbed]
        self._session.push_rows(spec, uniq, summed, versions, wait, wire_code)

    def push_stacked(self, tables: Sequence[str], ids: Sequence[IdsLike], grads: Union[torch.Tensor, np.ndarray],
                     versions: Sequence[Optional[Versions]], wire_dtype: Optional[str]) -> None:
        """``Client.push_stacked``: the checks of ``push`` over every table at once; the tables with neither a
        row cache nor a synchronous step, whose ids are sorted and unique, planned as one."""
        session = self._session
        specs = [session.catalog.table(t) for t in names(tables, "push_stacked's tables")]
        if len({s.dim for s in specs}) > 1:
            raise InvalidArgumentError(f"push_stacked takes tables of one width, got {[(s.name, s.dim) for s in specs]}")
        if not (len(ids) == len(specs) == len(versions)):
            raise InvalidArgumentError(f"{len(specs)} tables, {len(ids)} id arrays and {len(versions)} versions")
        per = [ids_to_numpy(i).reshape(-1) for i in ids]
        counts = np.array([i.shape[0] for i in per], dtype=np.int64)
        g = grads_to_numpy(grads, "push_stacked: grads")
        dim = specs[0].dim if specs else 0
        if tuple(g.shape) != (int(counts.sum()), dim):
            raise InvalidArgumentError(f"push_stacked: grads must have shape [{int(counts.sum())}, {dim}] (the ids of "
                                       f"every table, stacked), got {list(g.shape)}")
        flat = np.concatenate(per) if per else np.zeros(0, np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        some = counts > 0
        if some.any():  # every table's ids in range, in two reductions
            lo = np.minimum.reduceat(flat, starts[some])
            hi = np.maximum.reduceat(flat, starts[some])
            for t, a, b in zip(np.flatnonzero(some).tolist(), lo.tolist(), hi.tolist()):
                n = specs[t].num_embeddings
                if a < 0 or (n is not None and b >= n):
                    raise IdOutOfRangeError(f"{specs[t].name}: id {a if a < 0 else b} out of range [0, {n})")
        if not np.isfinite(g).all():
            bad = ~np.isfinite(g).all(axis=1)
            for t, spec in enumerate(specs):
                if not spec.allow_nonfinite and bad[starts[t] : starts[t] + counts[t]].any():
                    raise InvalidArgumentError(f"{spec.name}: gradient contains NaN or Inf; push rejected")
        increasing = np.ones(flat.shape[0], dtype=bool)
        np.greater(flat[1:], flat[:-1], out=increasing[1:])
        increasing[starts[some]] = True
        wire_code = session.wire(wire_dtype)
        for t, spec in enumerate(specs if wire_code in WIRE_INF else ()):  # (a narrow wire dtype's range)
            check_sent(g[int(starts[t]) : int(starts[t] + counts[t])], spec.name, wire_code, spec.allow_nonfinite)
        fused = []
        for t, spec in enumerate(specs):
            part = slice(int(starts[t]), int(starts[t] + counts[t]))
            if spec.sync is not None or spec.name in self._caches or not increasing[part].all():
                if counts[t] or spec.sync is not None:  # the general path (a synchronous table: even no ids)
                    self.push(spec.name, per[t], g[part], versions[t], False, wire_dtype)
            elif counts[t]:
                fused.append(t)
        if fused:
            idx = np.concatenate([np.arange(starts[t], starts[t] + counts[t]) for t in fused]) \
                if len(fused) < len(specs) else None
            session.push_rows_many([specs[t] for t in fused], [per[t] for t in fused], g if idx is None else g[idx],
                                   [versions[t] for t in fused], wire_code)
