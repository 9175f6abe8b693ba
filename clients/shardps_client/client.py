"""The shardps client: routes ids to shards, fans out in parallel, reassembles.

Usage::

    from shardps_client import Client, Adam
    with Client(["127.0.0.1:7000", "127.0.0.1:7001"]) as c:
        c.create_table("user", num_embeddings=1_000_000, dim=64, optimizer=Adam(lr=1e-3))
        rows = c.pull("user", ids)      # ids.shape + (64,)
        c.push("user", ids, grads)      # duplicate ids summed
        c.flush()                       # every push so far applied

``Client`` is a facade over parts with one job each: ``transport`` (channels,
deadlines, retries, lanes; the only module that imports grpc), ``planner`` (pure
functions that split requests by shard and size and reassemble replies),
``pushes`` (the push pipeline), ``worker`` (heartbeats, SSP clock, barrier) and
``admin`` (spec cache, shard map, checkpoints). This module turns user inputs
(tensors, arrays, lists) into checked numpy arrays and back into tensors.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from shardps.core import codec, wire
from shardps.core.errors import ExportGap as _ServerExportGap
from shardps.core.errors import InvalidArgument as _ServerInvalidArgument
from shardps.core.exports import Exporter, ExportResult
from shardps.core.ids import coalesce, is_sorted_unique, unique_ids
from shardps.core.memory import tune_malloc
from shardps.core.optim import SGD, Optimizer
from shardps.core.routing import name_hash
from shardps.core.specs import (
    Admission,
    DenseSpec,
    Eviction,
    Initializer,
    Staleness,
    SyncPolicy,
    TableSpec,
    dense_spec_to_pb,
    table_spec_to_pb,
)
from shardps.core.tokens import token_from_environment
from shardps.v1 import shardps_pb2 as pb
from shardps_client import admin, planner
from shardps_client.cache import CacheStats, RowCache
from shardps_client.errors import ExportGapError, IdOutOfRangeError, InvalidArgumentError, ShardpsError
from shardps_client.pushes import DensePull, PushHold, PushPipeline
from shardps_client.transport import TLS, Transport
from shardps_client.worker import WorkerClock

log = logging.getLogger(__name__)

MiB = 1 << 20
IdsLike = Union[torch.Tensor, np.ndarray, Sequence[int]]


@dataclass(frozen=True)
class Versions:
    """The shard versions a pull read at: ``{shard index: version}``; pass it back to ``push``."""

    by_shard: dict[int, int]

    @staticmethod
    def oldest(a: Versions, b: Versions) -> Versions:
        """The older version of each shard (rows read at two times: staleness counts from the older)."""
        return Versions({s: min(v, b.by_shard.get(s, v)) for s, v in a.by_shard.items()} |
                        {s: v for s, v in b.by_shard.items() if s not in a.by_shard})


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


class Client:
    """A connection to every shard of a cluster.

    Args:
        addresses: shard addresses ("host:port"); list position = shard index,
            checked against each shard on connect.
        timeout: deadline in seconds of every call.
        retry_timeout: how long calls keep retrying a shard that is UNAVAILABLE
            (restarting, not yet up) before raising ShardUnavailableError.
        wire_dtype: "float32", "float16" or "bfloat16" for rows and gradients on
            the wire (shards always store float32).
        max_message_bytes: requests and replies are split to stay below this
            (keep it under the shards' --max-message-mb).
        max_inflight_pushes: asynchronous pushes in flight before push() blocks.
        read_your_writes: a pull of a table sees this client's earlier pushes
            to it (so one worker sees its own updates). On streams a pull is
            served after them anyway; over unary calls (a shard that refused
            streams) the pull first waits for them.
        check_shard_map: verify each shard's (index, count) on connect.
        client_id: identity for exactly-once pushes (default: random).
        rank: this worker's rank (default: the RANK environment variable that
            torchrun sets). Needed for synchronous tables and SSP.
        world_size: number of workers (default: WORLD_SIZE).
        ssp_bound: bounded staleness: a worker whose clock (``advance_clock``)
            is more than this many steps ahead of the slowest live worker waits
            before its next pull (at most ``worker.SSP_WAIT_S``, then
            ShardTimeoutError). None: no bound.
        heartbeat_s: seconds between liveness heartbeats (sent while rank is known).
        torch_threads: torch's intra-op threads in this process. "auto" (the default):
            when shards run on this host (a loopback address) and neither
            OMP_NUM_THREADS nor an earlier ``torch.set_num_threads`` chose otherwise,
            one thread per core the local shards leave free (at least 1), because
            torch's idle threads spin and take the shards' cores. An int: that many.
            None: leave torch alone.
        tls: TLS to the shards (``TLS(ca, cert=None, key=None)``; files). None: TLS from
            SHARDPS_TLS_CA / SHARDPS_TLS_CLIENT_CERT / SHARDPS_TLS_CLIENT_KEY when set, else plaintext.
        token: the bearer token every call carries; None: the file SHARDPS_TOKEN_FILE names, else
            SHARDPS_TOKEN, else no token (what shards without ``--tokens-file`` expect).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        timeout: float = 30.0,
        retry_timeout: float = 30.0,
        wire_dtype: str = "float32",
        max_message_bytes: int = 4 * MiB - 64 * 1024,
        max_inflight_pushes: int = 32,
        read_your_writes: bool = True,
        check_shard_map: bool = True,
        client_id: Optional[str] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        ssp_bound: Optional[int] = None,
        heartbeat_s: float = 1.0,
        torch_threads: Union[int, str, None] = "auto",
        tls: Optional[TLS] = None,
        token: Optional[str] = None,
    ) -> None:
        if not addresses:
            raise InvalidArgumentError("Client needs at least one shard address")
        wire_code = _wire_code(wire_dtype)
        tune_malloc()  # message-sized buffers stay in the heap (see shardps.core.memory)
        _set_torch_threads(torch_threads, addresses)
        self.addresses = list(addresses)
        self.num_shards = len(self.addresses)
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self.wire_dtype = wire_code
        self.max_message_bytes = int(max_message_bytes)
        self.read_your_writes = read_your_writes
        self.client_id = client_id or uuid.uuid4().hex
        self.transport = Transport(self.addresses, timeout, retry_timeout, self.max_message_bytes,
                                   tls if tls is not None else TLS.from_environment(),
                                   token if token is not None else token_from_environment())
        self._pool = ThreadPoolExecutor(max_workers=max(4, 4 * self.num_shards), thread_name_prefix="shardps-client")
        self.catalog = admin.Catalog(self.transport)
        self.pushes = PushPipeline(self.transport, self.num_shards, self.max_message_bytes, max_inflight_pushes)
        self.worker = WorkerClock(self.transport, self.num_shards, rank, world_size, ssp_bound, self._pool.submit)
        self._seq = [itertools.count(1) for _ in self.addresses]
        self._seq_lock = threading.Lock()
        # (table, hash of the unique ids, wire) -> (unique ids, the ids pulled for them, their pull, cache epoch)
        self._prefetched: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray, Future, int]] = {}
        self._caches: dict[str, RowCache] = {}
        self._prefetch_lock = threading.Lock()
        self._hold: Optional[PushHold] = None  # defer_pushes
        self._closed = False
        if check_shard_map:
            self.check_shard_map()
        self.worker.start(heartbeat_s)

    @classmethod
    def from_file(cls, path: str, **kwargs: Any) -> Client:
        """Connect to the cluster described by a cluster file (written by ``shardps cluster``): its
        addresses, and its TLS files (``"tls": {"ca", "cert", "key"}``, paths) when it has them."""
        with open(path) as f:
            data = json.load(f)
        if data.get("tls") and "tls" not in kwargs:
            kwargs["tls"] = TLS(**data["tls"])
        return cls(data["addresses"], **kwargs)

    # ---- the parts' state, as attributes of the client ----------------------------------

    rank = property(lambda self: self.worker.rank, doc="this worker's rank (None: not a worker of a group)")
    world_size = property(lambda self: self.worker.world_size, doc="number of workers")
    ssp_bound = property(lambda self: self.worker.ssp_bound, doc="bounded staleness (None: no bound)")
    clock = property(lambda self: self.worker.clock, doc="this worker's SSP clock")
    sync_reports = property(lambda self: self.pushes.sync_reports,
                            doc="(table, missing ranks, late) of synchronous steps that did not include every worker")

    @property
    def defer_pushes(self) -> bool:
        """True while pushes are queued until send_pushes() (or flush(), or a pull that must see them), which
        sends one PushBatch per shard: set by the user, or while a ``hold_pushes`` handle is held (as a
        ``ShardedOptimizer`` holds one). Setting it False releases only the user's own hold."""
        return self.pushes.holding

    @defer_pushes.setter
    def defer_pushes(self, value: bool) -> None:
        if value and self._hold is None:
            self._hold = self.hold_pushes()
        elif not value and self._hold is not None:
            self._hold.release()
            self._hold = None

    def hold_pushes(self) -> PushHold:
        """A handle that queues this client's asynchronous pushes while held; ``send()`` sends them as one
        PushBatch per shard (``send_pushes``), ``release()`` stops holding. ``ShardedOptimizer`` holds one."""
        return self.pushes.hold(self.send_pushes)

    def _next_seq(self, shard: int) -> int:
        with self._seq_lock:
            return next(self._seq[shard])

    def _wire(self, wire_dtype: Optional[str]) -> int:
        return self.wire_dtype if wire_dtype is None else _wire_code(wire_dtype)

    def _see_own_pushes(self, key: str) -> None:
        """Before a pull of ``key`` (read_your_writes): make it see this client's pushes.

        Streaming lanes serve a pull after every push sent before it, so queued
        (deferred) pushes only need sending; over unary calls, wait for them.
        """
        if self.transport.streaming:
            if self.pushes.has_queued:
                self.send_pushes()
        else:
            self.pushes.wait(key)

    def check_shard_map(self) -> list[pb.ShardInfoResponse]:
        """Verify that shard i of the address list reports (index i, count len(addresses))."""
        return admin.check_shard_map(self.transport)

    def shard_info(self) -> list[pb.ShardInfoResponse]:
        """ShardInfo of every shard, in index order."""
        return admin.shard_info(self.transport)

    # ---- workers: heartbeats, SSP clocks ---------------------------------------------

    def advance_clock(self) -> int:
        """Mark the end of a training step (the SSP clock); returns the new clock."""
        return self.worker.advance()

    def barrier(self, timeout: float = 600.0) -> None:
        """Wait until every live worker's clock has reached this worker's clock.

        Workers that left (closed their client) or went silent are not waited
        for. Raises ShardTimeoutError after ``timeout`` seconds.
        """
        self.worker.barrier(timeout)

    # ---- tables ----------------------------------------------------------------------

    def create_table(
        self,
        name: str,
        dim: int,
        num_embeddings: Optional[int] = None,
        optimizer: Optional[Optimizer] = None,
        initializer: Optional[Initializer] = None,
        staleness: Optional[Staleness] = None,
        allow_nonfinite: bool = False,
        sync: Optional[SyncPolicy] = None,
        admission: Optional[Admission] = None,
        eviction: Optional[Eviction] = None,
    ) -> bool:
        """Create a table on every shard; True if created, False if an equal one existed.

        ``num_embeddings=None`` makes an unbounded table (any int64 id). The
        default initializer is normal(0, 1), like ``torch.nn.Embedding``, seeded
        from the table name. ``admission`` and ``eviction`` bound the table's
        memory (see ``Admission``, ``Eviction``). A table of the same name with
        another spec (policies included) raises TableExistsError.
        """
        try:
            spec = TableSpec(
                name=name, dim=dim, num_embeddings=num_embeddings, optimizer=optimizer or SGD(),
                initializer=initializer or Initializer(kind="normal", std=1.0, seed=name_hash(name) >> 1),
                staleness=staleness or Staleness(), allow_nonfinite=allow_nonfinite, sync=sync,
                admission=admission, eviction=eviction,
            )
        except _ServerInvalidArgument as e:
            raise InvalidArgumentError(str(e)) from None
        msg = table_spec_to_pb(spec)
        results = self.transport.fan_out([
            (s, "CreateTable", pb.CreateTableRequest(spec=msg, shard_map=planner.shard_map(s, self.num_shards)))
            for s in range(self.num_shards)
        ])
        self.catalog.remember(spec)
        return any(r.created for r in results)

    def table_spec(self, name: str) -> TableSpec:
        """The spec of a table (asked of shard 0 the first time, then cached)."""
        return self.catalog.table(name)

    def describe_table(self, name: str) -> list[pb.TableInfo]:
        """What each shard holds of a table or dense tensor (rows, bytes)."""
        return self.transport.fan_out([(s, "DescribeTable", pb.DescribeTableRequest(name=name))
                                       for s in range(self.num_shards)])

    def drop_table(self, name: str) -> bool:
        """Drop a table or dense tensor on every shard."""
        self.flush()
        results = self.transport.fan_out([(s, "DropTable", pb.DropTableRequest(name=name))
                                          for s in range(self.num_shards)])
        self.catalog.forget(name)
        return any(r.dropped for r in results)

    def _checked_ids(self, spec: TableSpec, ids: IdsLike) -> np.ndarray:
        ids_np = _ids_to_numpy(ids)
        if ids_np.size == 0:
            raise InvalidArgumentError(f"{spec.name}: request has no ids")
        if spec.num_embeddings is not None:
            lo, hi = int(ids_np.min()), int(ids_np.max())
            if lo < 0 or hi >= spec.num_embeddings:
                raise IdOutOfRangeError(
                    f"{spec.name}: id {lo if lo < 0 else hi} out of range [0, {spec.num_embeddings})"
                )
        return ids_np

    def pull(self, table: str, ids: IdsLike, device: Any = None, wire_dtype: Optional[str] = None) -> torch.Tensor:
        """Rows of ``ids`` (any shape): float32 tensor of shape ids.shape + (dim,)."""
        return self.pull_with_version(table, ids, device, wire_dtype)[0]

    def pull_with_version(
        self, table: str, ids: IdsLike, device: Any = None, wire_dtype: Optional[str] = None
    ) -> tuple[torch.Tensor, Versions]:
        """Like ``pull``, also returning the shard versions the rows were read at."""
        return self.pull_many({table: ids}, device, wire_dtype)[table]

    def prefetch(self, table: str, ids: IdsLike, wire_dtype: Optional[str] = None) -> Future:
        """Start pulling the rows of ``ids`` in the background.

        A later ``pull`` / ``pull_with_version`` (or a ``RemoteEmbedding``
        forward) of the same table and the same set of unique ids takes the
        prefetched rows instead of pulling again. Prefetches do not wait for
        this client's pending pushes.
        """
        return self.prefetch_many({table: ids}, wire_dtype)

    def _take_prefetched(self, table: str, uniq: np.ndarray,
                         wire_code: int) -> Optional[tuple[np.ndarray, np.ndarray, Versions]]:
        """(ids, rows, versions) prefetched for the unique ids ``uniq`` (all of them, or those a row cache
        did not hold then), or None."""
        with self._prefetch_lock:
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
        per_shard = planner.pull_plan(items, self.num_shards, wire_code, self.max_message_bytes)
        calls, metas = planner.pull_batches(per_shard, "Pull", lambda reqs: pb.PullBatchRequest(pulls=reqs),
                                            self.max_message_bytes)
        blocks = planner.pulled_blocks(calls, metas, self.transport.lane_calls(calls),
                                       pb.PullBatchResponse.PULLS_FIELD_NUMBER)
        return [(rows, Versions(v)) for rows, v in planner.assemble_rows(items, blocks)]

    def pull_many(
        self, requests: dict[str, IdsLike], device: Any = None, wire_dtype: Optional[str] = None
    ) -> dict[str, tuple[torch.Tensor, Versions]]:
        """Rows of several tables in one round trip per shard: ``{table: (rows, versions)}``.

        Tables whose unique ids were prefetched (``prefetch`` / ``prefetch_many``)
        take the prefetched rows; the others are pulled together.
        """
        wire_code = self._wire(wire_dtype)
        self.worker.ssp_wait()
        prepared = {}
        for table, ids in requests.items():
            spec = self.table_spec(table)
            ids_np = self._checked_ids(spec, ids)
            cache = self._caches.get(table)
            expired = cache.advance() if cache is not None else []  # a new step: rows past their k steps go
            for expired_ids, grads in expired:  # ... and their summed gradients out, before the pull reads them
                self._push_unique(spec, expired_ids, grads, None, False, wire_code)
            if self.read_your_writes or expired:
                self._see_own_pushes(table)
            flat = ids_np.reshape(-1)
            uniq, inverse = (flat, None) if is_sorted_unique(flat) else np.unique(flat, return_inverse=True)
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
                self._caches[table].admit(w.need, rows)
                rows = w.with_cached(rows)
            if w.inverse is not None:
                rows = rows[w.inverse.reshape(-1)]
            t = torch.from_numpy(rows.reshape(w.shape + (w.spec.dim,)))
            out[table] = ((t.to(device, non_blocking=True) if device is not None else t), versions)
        return out

    def prefetch_many(self, requests: dict[str, IdsLike], wire_dtype: Optional[str] = None,
                      steps_ahead: int = 1) -> Future:
        """Start pulling rows of several tables in one round trip per shard (see ``prefetch``).

        ``steps_ahead``: the rows are for the pull that many pulls of the table from now (``Prefetcher``
        passes its depth + 1); a row cache (``cache_table``) uses it to tell which rows it will serve then.
        """
        wire_code = self._wire(wire_dtype)
        items, futures = [], []
        for table, ids in requests.items():
            spec = self.table_spec(table)
            uniq = unique_ids(self._checked_ids(spec, ids).reshape(-1))
            cache = self._caches.get(table)
            need, epoch = uniq, 0
            if cache is not None:  # rows the cache will serve are not read; those it will not are read after
                sums = cache.flush_expiring(steps_ahead)  # their summed gradients went out
                for expiring, grads in sums:
                    self._push_unique(spec, expiring, grads, None, False, wire_code)
                if sums:
                    self._see_own_pushes(table)
                need, epoch = uniq[~cache.held(uniq)], cache.epoch
            items.append((spec, need))
            f: Future = Future()
            futures.append(f)
            with self._prefetch_lock:
                self._prefetched[(table, hash(uniq.tobytes()), wire_code)] = (uniq, need, f, epoch)
                while len(self._prefetched) > 256:
                    self._prefetched.pop(next(iter(self._prefetched)))

        def run() -> None:
            try:
                for f, r in zip(futures, self._pull_unique_many(items, wire_code)):
                    f.set_result(r)
            except BaseException as e:  # noqa: BLE001 - handed to whoever takes the prefetch
                for f in futures:
                    if not f.done():
                        f.set_exception(e)

        return self._pool.submit(run)

    def push(
        self,
        table: str,
        ids: IdsLike,
        grads: Union[torch.Tensor, np.ndarray],
        versions: Optional[Versions] = None,
        wait: bool = False,
        wire_dtype: Optional[str] = None,
    ) -> None:
        """Send gradients of ``ids`` (grads: ids.shape + (dim,)); duplicate ids are summed.

        Asynchronous: returns once the push is queued; a client's pushes reach
        each shard in the order they were made. ``flush()`` waits for them and
        raises any error a shard reported. ``versions`` (from
        ``pull_with_version``) lets shards compute staleness; ``wait=True``
        blocks until applied.
        """
        spec = self.table_spec(table)
        g = _grads_to_numpy(grads, f"{table}: grads")  # (converted first: errors in the order they always came)
        ids_np = self._checked_ids(spec, ids)
        _check_grads(g, table, "grads", ids_np.shape + (spec.dim,), "ids.shape + (dim,)",
                           spec.allow_nonfinite)
        uniq, summed = coalesce(ids_np.reshape(-1), g.reshape(-1, spec.dim))
        wire_code = self._wire(wire_dtype)  # before the step number: a refused push must not use one up
        cache = self._caches.get(table)
        if cache is not None:  # rows the cache holds sum their gradients locally
            absorbed = cache.accumulate(uniq, summed)
            if absorbed.all():
                return
            uniq, summed = uniq[~absorbed], summed[~absorbed]
        self._push_unique(spec, uniq, summed, versions, wait, wire_code)

    def _push_unique(self, spec: TableSpec, uniq: np.ndarray, summed: np.ndarray, versions: Optional[Versions],
                     wait: bool, wire_code: int) -> None:
        """Push the summed gradients of sorted unique ids."""
        sync_step = self.worker.next_sync_step(spec.name) if spec.sync is not None else 0
        calls = planner.push_plan(spec, uniq, summed, self.num_shards, wire_code, self.max_message_bytes,
                                  versions.by_shard if versions is not None else None, self.client_id,
                                  self._next_seq, sync_step, self.rank or 0)
        self.pushes.dispatch(spec.name, calls, wait)

    def send_pushes(self, pull_dense: Sequence[str] = ()) -> Optional[DensePull]:
        """Send the queued pushes (``defer_pushes``): one PushBatch per shard (or a few, below the size limit).

        ``pull_dense`` names dense tensors whose values should come back with the
        pushes: each shard reads its part once the pushes it got are applied, as a
        ``pull_dense_many`` right after them would, without a call of its own.
        Returns a ``DensePull`` holding them, or None when none were asked for or a
        shard's part would not fit in one reply (then pull them as usual).
        """
        returning = self._dense_pull(pull_dense) if pull_dense else None  # may raise: nothing is taken yet
        return self.pushes.send(returning)

    def _dense_pull(self, names: Sequence[str]) -> Optional[DensePull]:
        """The PullDenseRequests (framed as PushBatchRequest.pull_dense) that bring ``names`` back with a push."""
        specs = {name: self.dense_spec(name) for name in names}
        out = DensePull(specs, self.num_shards, Versions)
        sizes = [0] * self.num_shards
        for s, name, a, b, req, nbytes in planner.dense_pull_requests(specs, self.num_shards, self.wire_dtype,
                                                                       self.max_message_bytes):
            out.requests[s].append(wire.frame(pb.PushBatchRequest.PULL_DENSE_FIELD_NUMBER, req.SerializeToString()))
            out.pieces[s].append((name, a, b))
            sizes[s] += nbytes
        if max(sizes) > self.max_message_bytes // 2:
            return None
        return out

    def flush(self) -> None:
        """Push what the row caches summed (emptying them), wait until every push sent so far is applied, and
        raise the first error any of them met."""
        for table, cache in list(self._caches.items()):
            self._drain_cache(table, cache)
        self.pushes.flush()

    def _drain_cache(self, table: str, cache: RowCache) -> None:
        spec = self.table_spec(table)
        for ids, grads in cache.drain():
            self._push_unique(spec, ids, grads, None, False, self.wire_dtype)

    # ---- the trainer-side row cache ----------------------------------------------------

    def cache_table(self, table: str, steps: int, max_rows: int = 1_000_000) -> None:
        """Serve ``table``'s rows from this process for ``steps`` steps after each pull (bounded staleness).

        A row pulled at step s (a step: one pull of the table) is served locally
        at steps s .. s+steps-1, and the gradients pushed for it meanwhile are
        summed here and pushed as one when its steps are over, or at ``flush()``
        (see ``shardps_client.cache``). ``steps=0`` turns the cache off (what it
        summed is pushed): every pull and push then goes to the shards, exactly as
        without a cache. ``max_rows`` bounds the rows held (``max_rows * dim * 8``
        bytes). Synchronous tables cannot be cached.
        """
        spec = self.table_spec(table)
        if steps < 0:
            raise InvalidArgumentError(f"{table}: cache steps must be >= 0, got {steps}")
        if max_rows < 1:
            raise InvalidArgumentError(f"{table}: cache max_rows must be >= 1, got {max_rows}")
        if spec.sync is not None and steps:
            raise InvalidArgumentError(f"{table}: a synchronous table cannot be cached (every worker pushes every "
                                       "step)")
        old = self._caches.pop(table, None)
        if old is not None:
            self._drain_cache(table, old)
        if steps:
            self._caches[table] = RowCache(spec.dim, steps, max_rows)

    def cache_stats(self, table: str) -> Optional[CacheStats]:
        """Counters of ``table``'s row cache (None when it has none)."""
        cache = self._caches.get(table)
        return None if cache is None else cache.stats

    # ---- dense tensors ---------------------------------------------------------------

    def register_dense(
        self,
        name: str,
        value: Union[torch.Tensor, np.ndarray],
        optimizer: Optional[Optimizer] = None,
        staleness: Optional[Staleness] = None,
        chunk_bytes: int = 1 * MiB,
        allow_nonfinite: bool = False,
        sync: Optional[SyncPolicy] = None,
    ) -> bool:
        """Register a dense tensor with its initial value; True if this call created it.

        A tensor larger than ``chunk_bytes`` is split into row chunks spread
        over the shards. If the tensor exists with the same spec, rows already
        initialised keep their (possibly trained) values: first writer wins.
        """
        arr = _grads_to_numpy(value, f"{name}: value")
        if not np.isfinite(arr).all():
            raise InvalidArgumentError(f"{name}: initial value contains NaN or Inf")
        shape = tuple(arr.shape)
        rows2d = arr.reshape(shape[0], -1) if arr.ndim >= 2 else arr.reshape(1, -1)
        cols = rows2d.shape[1]
        chunk_rows = 0 if rows2d.nbytes <= chunk_bytes else max(1, chunk_bytes // (cols * 4))
        try:
            spec = DenseSpec(
                name=name, shape=shape, optimizer=optimizer or SGD(), staleness=staleness or Staleness(),
                chunk_rows=chunk_rows, allow_nonfinite=allow_nonfinite, sync=sync,
            )
        except _ServerInvalidArgument as e:
            raise InvalidArgumentError(str(e)) from None
        msg = dense_spec_to_pb(spec)
        calls = []
        for s, start, end in planner.dense_pieces(spec, self.num_shards, self.max_message_bytes, pb.FLOAT32):
            req = pb.RegisterDenseRequest(spec=msg, row_start=start, values=codec.encode(rows2d[start:end]),
                                          shard_map=planner.shard_map(s, self.num_shards))
            calls.append((s, "RegisterDense", req))
        # Every shard learns the spec (so any can describe it), also those owning no rows.
        for s in sorted(set(range(self.num_shards)) - {c[0] for c in calls}):
            calls.append((s, "RegisterDense",
                          pb.RegisterDenseRequest(spec=msg, shard_map=planner.shard_map(s, self.num_shards))))
        results = self.transport.fan_out(calls)
        self.catalog.remember(spec)
        return any(r.created for r in results)

    def dense_spec(self, name: str) -> DenseSpec:
        """The spec of a dense tensor (asked of shard 0 the first time, then cached)."""
        return self.catalog.dense(name)

    def pull_dense(
        self, name: str, device: Any = None, wire_dtype: Optional[str] = None
    ) -> tuple[torch.Tensor, Versions]:
        """The current value of a dense tensor (its registered shape) and the versions read at."""
        value, versions = self.pull_dense_many([name], wire_dtype)[name]
        return (value.to(device) if device is not None else value), versions

    def pull_dense_many(
        self, names: Sequence[str], wire_dtype: Optional[str] = None
    ) -> dict[str, tuple[torch.Tensor, Versions]]:
        """Several dense tensors in one parallel fan-out: ``{name: (value, versions)}``."""
        wire_code = self._wire(wire_dtype)
        self.worker.ssp_wait()
        specs = {name: self.dense_spec(name) for name in names}
        if self.read_your_writes:
            for name in names:
                self._see_own_pushes(name)
        per_shard = planner.dense_pull_plan(specs, self.num_shards, wire_code, self.max_message_bytes)
        calls, metas = planner.pull_batches(per_shard, "PullDense", lambda reqs: pb.PullBatchRequest(dense=reqs),
                                            self.max_message_bytes)
        pulled = planner.pulled_blocks(calls, metas, self.transport.lane_calls(calls),
                                       pb.PullBatchResponse.DENSE_FIELD_NUMBER)
        values = planner.assemble_dense(specs, ((s, name, a, b, rows, v) for s, name, (a, b), rows, v in pulled))
        return {name: (value, Versions(v)) for name, (value, v) in values.items()}

    def push_dense(
        self,
        name: str,
        grad: Union[torch.Tensor, np.ndarray],
        versions: Optional[Versions] = None,
        wait: bool = False,
        wire_dtype: Optional[str] = None,
    ) -> None:
        """Send the gradient of a whole dense tensor (asynchronous, like ``push``)."""
        spec = self.dense_spec(name)
        g = _grads_to_numpy(grad, f"{name}: grad")
        _check_grads(g, name, "grad", spec.shape, None, spec.allow_nonfinite)
        wire_code = self._wire(wire_dtype)  # before the step number: a refused push must not use one up
        sync_step = self.worker.next_sync_step(name) if spec.sync is not None else 0
        calls = planner.dense_push_plan(spec, g.reshape(spec.rows, spec.cols), self.num_shards, wire_code,
                                        self.max_message_bytes, versions.by_shard if versions is not None else None,
                                        self.client_id, self._next_seq, sync_step, self.rank or 0)
        self.pushes.dispatch(name, calls, wait)

    # ---- cluster operations ----------------------------------------------------------

    def checkpoint(self, checkpoint_id: Optional[str] = None, hold_s: float = 30.0) -> str:
        """Checkpoint every shard at one consistent point; returns the checkpoint id.

        Flushes this client's pushes, then runs a two-phase checkpoint: every
        shard holds new pushes back (PREPARE), then every shard copies its state
        and resumes (COMMIT) before writing its file. If any shard fails to
        prepare, the others are released (ABORT) and the error is raised.
        """
        self.flush()
        return admin.checkpoint(self.transport, checkpoint_id, hold_s)

    def export(self, out: Union[str, os.PathLike], tables: Optional[Sequence[str]] = None,
               optimizer_state: bool = False, hold_s: float = 30.0) -> ExportResult:
        """Write a base of the cluster's tables and dense tensors (or of ``tables``) to the export directory
        ``out``: every shard at one cut (two-phase, like ``checkpoint``), safetensors files and a manifest
        with checksums (``shardps.core.exports``). Optimizer state only with ``optimizer_state``. Flushes
        this client's pushes first."""
        self.flush()
        return self._exporter(hold_s).base(out, list(tables) if tables else None, optimizer_state)

    def export_delta(self, out: Union[str, os.PathLike], fallback_base: bool = False,
                     hold_s: float = 30.0) -> ExportResult:
        """Write the next delta of ``out``: rows changed since its last cut, tombstones of evicted ids, dropped
        tables. ExportGapError when the cluster cannot (a shard restarted, another shard map); with
        ``fallback_base`` a new base instead. Nothing changed: nothing written (``kind == "none"``)."""
        self.flush()
        try:
            return self._exporter(hold_s).delta(out, fallback_base)
        except _ServerExportGap as e:
            raise ExportGapError(str(e)) from None

    def _exporter(self, hold_s: float) -> Exporter:
        return Exporter(lambda s, method, request: self.transport.call(s, method, request), self.num_shards, hold_s)

    def state_dict(self, table: str) -> dict[str, torch.Tensor]:
        """The table as a ``torch.nn.Embedding`` state dict: ``{"weight": [num_embeddings, dim]}`` (CPU float32),
        for a table with ``num_embeddings`` small enough to hold here. Rows never pushed read as their
        initializer's values (an unbounded table creates them, as a pull does)."""
        spec = self.table_spec(table)
        if spec.num_embeddings is None:
            raise InvalidArgumentError(f"{table}: a state dict needs num_embeddings (export a table without it)")
        self.flush()
        weight = torch.empty(spec.num_embeddings, spec.dim, dtype=torch.float32)
        step = max(1, planner.rows_per_message(self.max_message_bytes, spec.dim, pb.FLOAT32) * self.num_shards)
        for start in range(0, spec.num_embeddings, step):
            ids = torch.arange(start, min(start + step, spec.num_embeddings), dtype=torch.int64)
            weight[start:start + ids.numel()] = self.pull(table, ids)
        return {"weight": weight}

    def load_state_dict(self, table: str, state_dict: dict[str, Any]) -> None:
        """Set every row of ``table`` from a ``torch.nn.Embedding`` state dict (``{"weight": [n, dim]}``; n is the
        table's num_embeddings, or any n for a table without one: ids 0..n-1). Optimizer state of existing rows
        is kept, as ``Module.load_state_dict`` leaves an optimizer's; each row counts as changed (the next
        export delta carries it)."""
        spec = self.table_spec(table)
        unexpected = set(state_dict) - {"weight"}
        if "weight" not in state_dict or unexpected:
            raise InvalidArgumentError(f"{table}: a state dict of one key 'weight' expected, got {sorted(state_dict)}")
        w = _grads_to_numpy(state_dict["weight"], f"{table}: weight")
        n = spec.num_embeddings if spec.num_embeddings is not None else w.shape[0]
        _check_grads(w, table, "weight", (n, spec.dim), "num_embeddings x dim", False)
        self.flush()
        ids = np.arange(n, dtype=np.int64)
        calls = []
        for s, idx in planner.id_pieces(ids, self.num_shards, planner.rows_per_message(
                self.max_message_bytes, spec.dim, pb.FLOAT32)):
            calls.append((s, "Assign", pb.AssignRequest(table=table, ids=codec.encode(ids[idx]),
                                                        values=codec.encode(w[idx]),
                                                        shard_map=planner.shard_map(s, self.num_shards))))
        self.transport.fan_out(calls)  # flush() emptied any row cache of the table, so none serves old rows

    def close(self) -> None:
        """Flush pending pushes (errors are logged) and close the channels."""
        if self._closed:
            return
        try:
            self.flush()
        except ShardpsError as e:
            log.error("pending push failed at close: %s", e)
        finally:
            self.worker.stop()
            self._closed = True
            self._pool.shutdown(wait=True)
            self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wire_code(wire_dtype: str) -> int:
    if wire_dtype not in planner.WIRE:
        raise InvalidArgumentError(f"wire_dtype must be one of {sorted(planner.WIRE)}, got {wire_dtype!r}")
    return planner.WIRE[wire_dtype]


_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # at import: a later change is the user's choice
_LOOPBACK = ("127.", "localhost:", "[::1]:", "::1")


def _set_torch_threads(setting: Union[int, str, None], addresses: Sequence[str]) -> None:
    """Apply ``Client(torch_threads=...)`` (see its docstring)."""
    if setting is None:
        return
    if isinstance(setting, bool) or not (setting == "auto" or isinstance(setting, int)):
        raise InvalidArgumentError(f"torch_threads must be 'auto', a positive int or None, got {setting!r}")
    if isinstance(setting, int):
        if setting < 1:
            raise InvalidArgumentError(f"torch_threads must be >= 1, got {setting}")
        torch.set_num_threads(setting)
        return
    local = sum(1 for a in addresses if a.startswith(_LOOPBACK))
    current = torch.get_num_threads()
    if not local or os.environ.get("OMP_NUM_THREADS") or current != _TORCH_DEFAULT_THREADS:
        return
    threads = max(1, (os.cpu_count() or 1) - local)
    if threads < current:
        torch.set_num_threads(threads)
        log.info("%d shard(s) run on this host: torch uses %d intra-op thread(s), not %d, so its idle threads "
                 "do not spin on the shards' cores (Client(torch_threads=None) leaves torch alone)",
                 local, threads, current)


def _ids_to_numpy(ids: IdsLike) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(f"ids must be an integer tensor (int64 or int32), got {ids.dtype}")
        return ids.detach().to("cpu", torch.int64).numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"ids must be integers, got {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 2**63:
        raise IdOutOfRangeError("ids must fit in int64")
    return arr.astype(np.int64, copy=False)


def _grads_to_numpy(g: Union[torch.Tensor, np.ndarray], what: str) -> np.ndarray:
    if isinstance(g, torch.Tensor):
        if not g.is_floating_point():
            raise InvalidArgumentError(f"{what} must be a floating-point tensor, got {g.dtype}")
        return g.detach().to("cpu", torch.float32).numpy()
    arr = np.asarray(g)
    if arr.dtype.kind != "f":
        raise InvalidArgumentError(f"{what} must be floating point, got {arr.dtype}")
    return arr.astype(np.float32, copy=False)


def _check_grads(arr: np.ndarray, name: str, noun: str, shape: tuple, shape_words: Optional[str],
                 allow_nonfinite: bool) -> None:
    """Refuse gradients not of ``shape``, or not finite unless the table allows it."""
    if tuple(arr.shape) != tuple(shape):
        words = f" ({shape_words})" if shape_words else ""
        raise InvalidArgumentError(f"{name}: {noun} must have shape {list(shape)}{words}, got {list(arr.shape)}")
    if not allow_nonfinite and not np.isfinite(arr).all():
        raise InvalidArgumentError(f"{name}: gradient contains NaN or Inf; push rejected")


__all__ = ["Client", "DensePull", "PushHold", "Versions"]
