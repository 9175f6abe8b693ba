"""The pull path of tables: pulls, prefetches, and the rows row caches serve.

A pull of several tables (``Pulls.pull_many``) starts a step of each table's
row cache (its expired sums are pushed first), makes the pull see this client's
pushes (read-your-writes), takes the rows the cache holds and those a prefetch
brought, and reads the rest from the shards in one round trip per shard.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from shardps.core import codec, wire
from shardps.core.ids import unique_ids, unique_inverse
from shardps.core.slots import SlotMap
from shardps.core.specs import TableSpec
from shardps.v1 import shardps_pb2 as pb
from shardps_client import planner
from shardps_client.cached_tables import CachedTables
from shardps_client.errors import ShardpsError
from shardps_client.inputs import IdsLike, checked_ids_in_order
from shardps_client.pushes import answer_here
from shardps_client.session import Session
from shardps_client.versions import Versions

log = logging.getLogger(__name__)

MAX_PREFETCHED = 256  # prefetches kept for their pulls; the oldest go first


@dataclass
class _Wanted:
    """One table's part of a pull: its unique ids, those a row cache holds, those a prefetch brought."""

    spec: TableSpec
    shape: tuple[int, ...]
    uniq: np.ndarray
    inverse: Optional[np.ndarray]
    cached: Optional[tuple[np.ndarray, np.ndarray]] = None  # (mask over uniq, rows of the held ids)
    need: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # ids to read from the shards
    prefetched: Optional[tuple[np.ndarray, np.ndarray, Versions]] = None  # (ids, rows, versions)
    have: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # mask over need: prefetched

    @property
    def to_pull(self) -> np.ndarray:
        return self.need if self.prefetched is None else self.need[~self.have]

    def rows_of_need(self, pulled: Optional[tuple[np.ndarray, Versions]]) -> tuple[np.ndarray, Versions]:
        """Rows of ``need`` from the prefetch and ``pulled`` (the rows of ``to_pull``)."""
        if self.prefetched is None:
            assert pulled is not None
            rows, versions = pulled
        else:
            ids, got, versions = self.prefetched
            if ids.shape[0] == self.need.shape[0] and self.have.all():  # the prefetch brought exactly these
                rows = got
            else:
                rows = np.empty((self.need.shape[0], self.spec.dim), dtype=np.float32)
                rows[self.have] = got[np.searchsorted(ids, self.need[self.have])]
            if pulled is not None:
                rows[~self.have] = pulled[0]
                versions = Versions.oldest(versions, pulled[1])
        return rows, versions

    def with_cached(self, rows: np.ndarray) -> np.ndarray:
        """Rows of ``uniq``: those the cache held, and ``rows`` (of ``need``) for the others."""
        if self.cached is None:
            return rows
        hit, hit_rows = self.cached
        full = np.empty((self.uniq.shape[0], self.spec.dim), dtype=np.float32)
        full[hit] = hit_rows
        full[~hit] = rows
        return full


class Pulls:
    """Pulls and prefetches of one client's tables (see the module docstring)."""

    def __init__(self, session: Session, caches: CachedTables) -> None:
        self._session = session
        self._caches = caches
        # (table, hash of the unique ids, wire) -> (unique ids, the ids pulled for them, their pull, cache epoch)
        self._prefetched: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray, Future, int]] = {}
        self._lock = threading.Lock()

    def pull_many(self, requests: dict[str, IdsLike], device: Any,
                  wire_dtype: Optional[str]) -> dict[str, tuple[torch.Tensor, Versions]]:
        """``Client.pull_many``."""
        session = self._session
        wire_code = session.wire(wire_dtype)
        session.worker.ssp_wait()
        prepared = {}
        for table, ids in requests.items():
            spec = session.catalog.table(table)
            ids_np, ordered = checked_ids_in_order(spec, ids)
            cache = self._caches.get(table)
            expired = cache.advance() if cache is not None else []  # a new step: rows past their k steps go
            for expired_ids, grads in expired:  # ... and their summed gradients out, before the pull reads them
                session.push_rows(spec, expired_ids, grads, None, False, wire_code)
            if session.read_your_writes or expired:
                session.see_own_pushes(table)
            flat = ids_np.reshape(-1)
            uniq, inverse = (flat, None) if ordered else unique_inverse(flat)
            w = _Wanted(spec, ids_np.shape, uniq, inverse, cached=cache.lookup(uniq) if cache is not None else None)
            w.need = uniq[~w.cached[0]] if w.cached is not None else uniq
            w.prefetched = self._take_prefetched(table, uniq, wire_code)
            if w.prefetched is not None:  # (without a cache, a prefetch as long as need brought all of uniq)
                same = w.cached is None and w.prefetched[0].shape[0] == w.need.shape[0]
                w.have = np.ones(w.need.shape[0], dtype=bool) if same else planner.found_in(w.prefetched[0], w.need)
            prepared[table] = w
        missing = [t for t, w in prepared.items() if w.prefetched is None or not w.have.all()]
        pulled = dict(zip(missing, self._pull_unique_many([(prepared[t].spec, prepared[t].to_pull) for t in missing],
                                                          wire_code)))
        out = {}
        for table, w in prepared.items():
            rows, versions = w.rows_of_need(pulled.get(table))
            if w.cached is not None:
                cache = self._caches.get(table)
                assert cache is not None
                cache.admit(w.need, rows)
                rows = w.with_cached(rows)
            if w.inverse is not None:
                rows = rows[w.inverse.reshape(-1)]
            t = torch.from_numpy(rows.reshape(w.shape + (w.spec.dim,)))
            out[table] = ((t.to(device, non_blocking=True) if device is not None else t), versions)
        return out

    def prefetch_many(self, requests: dict[str, IdsLike], wire_dtype: Optional[str], steps_ahead: int) -> Future:
        """``Client.prefetch_many``."""
        session = self._session
        wire_code = session.wire(wire_dtype)
        items, futures, keys = [], [], []
        for table, ids in requests.items():
            spec = session.catalog.table(table)
            ids_np, ordered = checked_ids_in_order(spec, ids)
            flat = ids_np.reshape(-1)
            uniq = flat.copy() if ordered else unique_ids(flat)  # (a copy: the caller may reuse its array)
            cache = self._caches.get(table)
            need, epoch = uniq, 0
            if cache is not None:  # rows the cache will serve are not read; those it will not are read after
                sums = cache.flush_expiring(steps_ahead)  # their summed gradients went out
                for expiring, grads in sums:
                    session.push_rows(spec, expiring, grads, None, False, wire_code)
                if sums:
                    session.see_own_pushes(table)
                need, epoch = uniq[~cache.held(uniq)], cache.epoch
            items.append((spec, need))
            f: Future = Future()
            futures.append(f)
            keys.append((table, hash(uniq.tobytes()), wire_code))
            with self._lock:
                self._prefetched[keys[-1]] = (uniq, need, f, epoch)
                while len(self._prefetched) > MAX_PREFETCHED:
                    self._prefetched.pop(next(iter(self._prefetched)))
        carry = session.pushes.expect_carry() if all(u.shape[0] for _, u in items) else None

        def run() -> None:
            try:
                got = self._carried(items, wire_code, carry) if carry is not None else None
                if got is None:
                    got = self._pull_unique_many(items, wire_code)
                for f, r in zip(futures, got):
                    f.set_result(r)
            except BaseException as e:  # noqa: BLE001 - handed to whoever takes the prefetch
                for f in futures:
                    if not f.done():
                        f.set_exception(e)

        out = session.pool.submit(run)
        out.forget = lambda: self._forget(keys)  # type: ignore[attr-defined]  # (``Prefetcher``: never taken)
        return out

    def _forget(self, keys: list[tuple[str, int, int]]) -> None:
        """Drop prefetches nothing will take (a ``Prefetcher`` loop that stopped early): a later pull of the same ids
        must not be served the rows they read then."""
        with self._lock:
            for key in keys:
                self._prefetched.pop(key, None)

    def _carried(self, items: list[tuple[TableSpec, np.ndarray]], wire_code: int,
                 carry: threading.Event) -> Optional[list[tuple[np.ndarray, Versions]]]:
        """A prefetch's rows pulled in the calls that carry a step's parked pushes (``PushPipeline.carry``), one per
        shard, each read there once the pushes are applied; None when nothing is parked now (the pushes went without
        it) or the pulls would not fit: pulled as usual."""
        session = self._session
        try:
            per_shard = planner.pull_plan(items, session.slots, wire_code, session.max_message_bytes)
            field = pb.PushBatchRequest.PULLS_FIELD_NUMBER
            fits = all(sum(e[3] for e in entries) <= session.max_message_bytes // 2 for entries in per_shard)
            calls = session.pushes.carry([[wire.frame(field, e[2]) for e in entries] for entries in per_shard]
                                         if fits else [])
        finally:
            carry.set()
        if calls is None or not fits:
            return None
        blocks = []
        for s, entries in enumerate(per_shard):
            if not entries:
                continue
            answer_here(calls[s])
            replies = list(calls[s].result().pulled)
            if len(replies) != len(entries):  # left out: a slot moved, a table gone (the pull says which)
                raise ShardpsError(f"shard {s} answered {len(replies)} of the {len(entries)} pulls carried with its "
                                   "pushes")
            for (k, part, _, _), r in zip(entries, replies):
                rows = codec.decode(r.rows, f"{items[k][0].name}: rows")
                blocks.append((s, k, part, rows, r.version))  # (assemble_rows checks the shape against the spec)
        return [(rows, Versions(v)) for rows, v in planner.assemble_rows(items, blocks)]

    def _take_prefetched(self, table: str, uniq: np.ndarray,
                         wire_code: int) -> Optional[tuple[np.ndarray, np.ndarray, Versions]]:
        """(ids, rows, versions) prefetched for the unique ids ``uniq`` (all of them, or those a row cache
        did not hold then), or None."""
        with self._lock:
            entry = self._prefetched.pop((table, hash(uniq.tobytes()), wire_code), None)
        if entry is None or not np.array_equal(entry[0], uniq):
            return None
        try:
            rows, versions = entry[2].result()
        except ShardpsError as e:
            log.warning("prefetch of %s failed (%s); pulling again", table, e)
            return None
        ids = entry[1]
        cache = self._caches.get(table)
        if cache is not None:  # rows whose summed gradients went out after the prefetch read them: read again
            fresh = ~cache.pushed_since(entry[3], ids)
            if not fresh.all():
                ids, rows = ids[fresh], rows[fresh]
        return ids, rows, versions

    def _pull_unique_many(
        self, items: list[tuple[TableSpec, np.ndarray]], wire_code: int
    ) -> list[tuple[np.ndarray, Versions]]:
        """Rows of sorted unique ids of several tables: one call per shard (more if over the size limit)."""
        if not all(u.shape[0] for _, u in items):  # (a cache can leave a table nothing to pull)
            some = [(spec, u) for spec, u in items if u.shape[0]]
            got = iter(self._pull_unique_many(some, wire_code) if some else [])
            return [next(got) if u.shape[0] else (np.zeros((0, spec.dim), np.float32), Versions({}))
                    for spec, u in items]
        session = self._session

        def pull(slots: SlotMap) -> list[tuple[np.ndarray, Versions]]:
            per_shard = planner.pull_plan(items, slots, wire_code, session.max_message_bytes)
            calls, metas = planner.pull_batches(per_shard, "Pull", planner.pull_batch,
                                                session.max_message_bytes)
            replies = session.transport.read_calls(calls, then=session.pushes.send_trailing)
            blocks = planner.pulled_blocks(calls, metas, replies, pb.PullBatchResponse.PULLS_FIELD_NUMBER)
            return [(rows, Versions(v)) for rows, v in planner.assemble_rows(items, blocks)]

        return session.routed(pull)
