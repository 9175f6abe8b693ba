"""Tables served from a trainer-side row cache (``Client.cache_table``), and pushes of table rows.

Every push of a table's rows passes here: rows a cache holds sum their
gradients locally (``shardps_client.cache``), the rest go to the shards.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import numpy as np
import torch

from shardps.core.ids import coalesce
from shardps_client.cache import CacheStats, RowCache
from shardps_client.errors import InvalidArgumentError
from shardps_client.inputs import IdsLike, check_grads, checked_ids, grads_to_numpy
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
        if steps < 0:
            raise InvalidArgumentError(f"{table}: cache steps must be >= 0, got {steps}")
        if max_rows < 1:
            raise InvalidArgumentError(f"{table}: cache max_rows must be >= 1, got {max_rows}")
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
        cache = self._caches.get(table)
        if cache is not None:  # rows the cache holds sum their gradients locally
            absorbed = cache.accumulate(uniq, summed)
            if absorbed.all():
                return
            uniq, summed = uniq[~absorbed], summed[~absorbed]
        self._session.push_rows(spec, uniq, summed, versions, wait, wire_code)
