"""The shardps client: routes ids to shards, fans out in parallel, reassembles.

Usage::

    from shardps_client import Client, Adam
    with Client(["127.0.0.1:7000", "127.0.0.1:7001"]) as c:
        c.create_table("user", num_embeddings=1_000_000, dim=64, optimizer=Adam(lr=1e-3))
        rows = c.pull("user", ids)      # ids.shape + (64,)
        c.push("user", ids, grads)      # duplicate ids summed
        c.flush()                       # every push so far applied
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import logging
import os
import random
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import grpc
import numpy as np
import torch

from shardps.core import codec, protocol, wire
from shardps.core.errors import InvalidArgument as _ServerInvalidArgument
from shardps.core.ids import coalesce, is_sorted_unique, unique_ids
from shardps.core.memory import tune_malloc
from shardps.core.optim import SGD, Optimizer
from shardps.core.routing import dense_row_ranges, name_hash, split_by_shard
from shardps.core.specs import (
    DenseSpec,
    Initializer,
    Staleness,
    SyncPolicy,
    TableSpec,
    dense_spec_from_pb,
    dense_spec_to_pb,
    table_spec_from_pb,
    table_spec_to_pb,
)
from shardps.v1 import shardps_pb2 as pb
from shardps_client.errors import (
    IdOutOfRangeError,
    InvalidArgumentError,
    ShardMapError,
    ShardpsError,
    from_rpc_error,
)
from shardps_client.stream import Lane

log = logging.getLogger(__name__)

MiB = 1 << 20
_WIRE = {"float32": pb.FLOAT32, "float16": pb.FLOAT16, "bfloat16": pb.BFLOAT16}
_WIRE_BYTES = {pb.FLOAT32: 4, pb.FLOAT16: 2, pb.BFLOAT16: 2}
IdsLike = Union[torch.Tensor, np.ndarray, Sequence[int]]


@dataclass(frozen=True)
class Versions:
    """The shard versions a pull read at: ``{shard index: version}``; pass it back to ``push``."""

    by_shard: dict[int, int]


class Client:
    """A connection to every shard of a cluster.

    Args:
        addresses: shard addresses ("host:port"); list position = shard index,
            checked against each shard on connect.
        timeout: deadline in seconds of every call.
        retry_timeout: how long calls keep retrying a shard that is UNAVAILABLE
            (restarting, not yet up) before raising ShardUnavailableError.
        wire_dtype: "float32", "float16" or "bfloat16" for rows and gradients on
            the wire_code (shards always store float32).
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
            before its next pull. None: no bound.
        heartbeat_s: seconds between liveness heartbeats (sent while rank is known).
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
    ) -> None:
        if not addresses:
            raise InvalidArgumentError("Client needs at least one shard address")
        if wire_dtype not in _WIRE:
            raise InvalidArgumentError(f"wire_dtype must be one of {sorted(_WIRE)}, got {wire_dtype!r}")
        tune_malloc()  # message-sized buffers stay in the heap (see shardps.core.memory)
        self.addresses = list(addresses)
        self.num_shards = len(self.addresses)
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self.wire_dtype = _WIRE[wire_dtype]
        self.max_message_bytes = int(max_message_bytes)
        self.read_your_writes = read_your_writes
        self.client_id = client_id or uuid.uuid4().hex
        limit = max(self.max_message_bytes + 64 * 1024, 4 * MiB)
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        self._channels = [grpc.insecure_channel(a, options=options) for a in self.addresses]
        self._stubs = [_Stub(ch) for ch in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=max(4, 4 * self.num_shards), thread_name_prefix="shardps-client")
        # One lane per shard carries this client's pulls and pushes to it on one stream, in the
        # order they were made (optimizers such as Adam are not commutative, and a pull sees the
        # pushes before it), many in flight; lanes of different shards run in parallel.
        self._lanes = [
            Lane(ch, a, functools.partial(self._call, i), self.timeout, self.retry_timeout)
            for i, (ch, a) in enumerate(zip(self._channels, self.addresses))
        ]
        self._seq = [itertools.count(1) for _ in self.addresses]
        self._seq_lock = threading.Lock()
        self._tables: dict[str, TableSpec] = {}
        self._dense: dict[str, DenseSpec] = {}
        self._pending: dict[str, set[Future]] = {}
        self._pending_lock = threading.Lock()
        self._inflight = threading.BoundedSemaphore(max_inflight_pushes)
        self._errors: list[BaseException] = []
        self._closed = False
        #: When True, push() and push_dense() queue their requests until send_pushes() (or flush(),
        #: or a pull that must see them), which sends one PushBatch per shard. ShardedOptimizer sets it.
        self.defer_pushes = False
        self._deferred: list[tuple[str, list[tuple[int, str, Any]]]] = []
        self.rank = rank if rank is not None else _env_int("RANK")
        self.world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
        if self.rank is not None and self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(f"rank {self.rank} is not in [0, world_size {self.world_size})")
        if ssp_bound is not None and (ssp_bound < 0 or self.rank is None):
            raise InvalidArgumentError("ssp_bound needs a rank (RANK or rank=) and must be >= 0")
        self.ssp_bound = ssp_bound
        self.clock = 0
        self._min_clock = 0
        self._sync_steps: dict[str, int] = {}
        #: (table, step, missing ranks, late) of synchronous steps that did not include every worker.
        self.sync_reports: collections.deque = collections.deque(maxlen=1000)
        self._prefetched: dict[tuple[str, int, int], tuple[np.ndarray, Future]] = {}
        self._stop = threading.Event()
        self._heartbeat_thread: Optional[threading.Thread] = None
        if check_shard_map:
            self.check_shard_map()
        if self.rank is not None:
            self._heartbeat()
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeat_loop, args=(heartbeat_s,), name="shardps-heartbeat", daemon=True
            )
            self._heartbeat_thread.start()

    @classmethod
    def from_file(cls, path: str, **kwargs: Any) -> Client:
        """Connect to the cluster described by a cluster file (written by ``shardps cluster``)."""
        with open(path) as f:
            data = json.load(f)
        return cls(data["addresses"], **kwargs)

    # ---- plumbing --------------------------------------------------------------------

    def _call(self, shard: int, method: str, request: Any, retry: bool = True) -> Any:
        """One RPC with a deadline, retried with backoff while the shard is UNAVAILABLE."""
        stub_method = getattr(self._stubs[shard], method)
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
        while True:
            try:
                return stub_method(request, timeout=self.timeout)
            except grpc.RpcError as e:
                if retry and e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() + delay < deadline:
                    time.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 1.0)
                    continue
                raise from_rpc_error(e, self.addresses[shard], method) from None

    def _fan_out(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Run calls on their shards in parallel; results in order; raises the first error.

        Uses gRPC's own futures (no thread pool), so it is safe from any thread,
        including the client's pool (prefetches); a call whose shard is
        UNAVAILABLE is then retried through ``_call``'s backoff.
        """
        if len(calls) == 1:
            return [self._call(*calls[0])]
        futures = [getattr(self._stubs[s], method).future(req, timeout=self.timeout) for s, method, req in calls]

        def result(call: tuple[int, str, Any], f: Any) -> Any:
            try:
                return f.result()
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(e, self.addresses[call[0]], call[1]) from None
                return self._call(*call)

        return _results([functools.partial(result, call, f) for call, f in zip(calls, futures)])

    def _lane_calls(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Run pull calls on their shards' lanes (in order after this client's earlier pushes).

        Results in order; raises the first error once every call has finished.
        """
        futures = [self._lanes[s].submit(method, wire.frame(protocol.stream_field(method), req.SerializeToString()))
                   for s, method, req in calls]
        return _results([f.result for f in futures])

    def _see_own_pushes(self, key: str) -> None:
        """Before a pull of ``key`` (read_your_writes): make it see this client's pushes.

        Streaming lanes serve a pull after every push sent before it, so queued
        (deferred) pushes only need sending; over unary calls, wait for them.
        """
        if all(lane.streaming for lane in self._lanes):
            if self._deferred:
                self.send_pushes()
        else:
            self._wait_pending(key)

    def _map(self, shard: int) -> pb.ShardMap:
        return pb.ShardMap(shard_index=shard, num_shards=self.num_shards)

    def check_shard_map(self) -> list[pb.ShardInfoResponse]:
        """Verify that shard i of the address list reports (index i, count len(addresses))."""
        infos = self.shard_info()
        for i, info in enumerate(infos):
            if (info.shard_index, info.num_shards) != (i, self.num_shards):
                raise ShardMapError(
                    f"address list does not match the cluster: position {i} ({self.addresses[i]}) is shard "
                    f"{info.shard_index} of {info.num_shards}, but the client was given {self.num_shards} "
                    f"addresses (list the shards in index order 0..{info.num_shards - 1})",
                    address=self.addresses[i],
                )
        return infos

    def shard_info(self) -> list[pb.ShardInfoResponse]:
        """ShardInfo of every shard, in index order."""
        return self._fan_out([(s, "ShardInfo", pb.ShardInfoRequest()) for s in range(self.num_shards)])

    def _next_seq(self, shard: int) -> int:
        with self._seq_lock:
            return next(self._seq[shard])

    # ---- workers: heartbeats, SSP clocks ---------------------------------------------

    def _heartbeat(self, leaving: bool = False, wait_min_clock: Optional[int] = None, wait_s: float = 0.0) -> None:
        req = pb.HeartbeatRequest(rank=self.rank or 0, world_size=self.world_size or 0, clock=self.clock,
                                  leaving=leaving, wait_s=wait_s)
        if wait_min_clock is not None:
            req.wait_min_clock = wait_min_clock
        replies = self._fan_out([(s, "Heartbeat", req) for s in range(self.num_shards)])
        self._min_clock = min(r.min_clock for r in replies)

    def _heartbeat_loop(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self._heartbeat()
            except ShardpsError as e:
                log.debug("heartbeat failed: %s", e)

    def advance_clock(self) -> int:
        """Mark the end of a training step (the SSP clock); returns the new clock."""
        self.clock += 1
        if self.rank is not None:
            self._pool.submit(self._heartbeat)
        return self.clock

    def barrier(self, timeout: float = 600.0) -> None:
        """Wait until every live worker's clock has reached this worker's clock.

        Workers that left (closed their client) or went silent are not waited
        for. Raises ShardTimeoutError after ``timeout`` seconds.
        """
        if self.rank is None:
            raise InvalidArgumentError("barrier needs a rank (RANK/WORLD_SIZE or Client(rank=...))")
        deadline = time.monotonic() + timeout
        self._heartbeat()
        while self._min_clock < self.clock:
            if time.monotonic() > deadline:
                from shardps_client.errors import ShardTimeoutError

                raise ShardTimeoutError(f"barrier: workers still below clock {self.clock} after {timeout}s")
            self._heartbeat(wait_min_clock=self.clock, wait_s=1.0)

    def _ssp_wait(self) -> None:
        """Bounded staleness: wait while this worker is more than ssp_bound steps ahead."""
        if self.ssp_bound is None:
            return
        while self.clock - self._min_clock > self.ssp_bound and not self._closed:
            self._heartbeat(wait_min_clock=self.clock - self.ssp_bound, wait_s=1.0)

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
    ) -> bool:
        """Create a table on every shard; True if created, False if an equal one existed.

        ``num_embeddings=None`` makes an unbounded table (any int64 id). The
        default initializer is normal(0, 1), like ``torch.nn.Embedding``, seeded
        from the table name. A table of the same name with another spec raises
        TableExistsError.
        """
        try:
            spec = TableSpec(
                name=name, dim=dim, num_embeddings=num_embeddings, optimizer=optimizer or SGD(),
                initializer=initializer or Initializer(kind="normal", std=1.0, seed=name_hash(name) >> 1),
                staleness=staleness or Staleness(), allow_nonfinite=allow_nonfinite, sync=sync,
            )
        except _ServerInvalidArgument as e:
            raise InvalidArgumentError(str(e)) from None
        msg = table_spec_to_pb(spec)
        results = self._fan_out(
            [(s, "CreateTable", pb.CreateTableRequest(spec=msg, shard_map=self._map(s))) for s in range(self.num_shards)]
        )
        self._tables[name] = spec
        return any(r.created for r in results)

    def table_spec(self, name: str) -> TableSpec:
        """The spec of a table (asked of shard 0 the first time, then cached)."""
        spec = self._tables.get(name)
        if spec is None:
            info = self._call(0, "DescribeTable", pb.DescribeTableRequest(name=name))
            if not info.HasField("spec"):
                raise InvalidArgumentError(f"{name!r} is a dense tensor, not a table")
            spec = self._tables[name] = table_spec_from_pb(info.spec)
        return spec

    def describe_table(self, name: str) -> list[pb.TableInfo]:
        """What each shard holds of a table or dense tensor (rows, bytes)."""
        return self._fan_out([(s, "DescribeTable", pb.DescribeTableRequest(name=name)) for s in range(self.num_shards)])

    def drop_table(self, name: str) -> bool:
        """Drop a table or dense tensor on every shard."""
        self.flush()
        results = self._fan_out([(s, "DropTable", pb.DropTableRequest(name=name)) for s in range(self.num_shards)])
        self._tables.pop(name, None)
        self._dense.pop(name, None)
        return any(r.dropped for r in results)

    def _check_ids(self, spec: TableSpec, ids: np.ndarray) -> None:
        if ids.size == 0:
            raise InvalidArgumentError(f"{spec.name}: request has no ids")
        if spec.num_embeddings is not None:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= spec.num_embeddings:
                raise IdOutOfRangeError(
                    f"{spec.name}: id {lo if lo < 0 else hi} out of range [0, {spec.num_embeddings})"
                )

    def _rows_per_message(self, dim: int, wire_code: int) -> int:
        return max(1, self.max_message_bytes // (dim * _WIRE_BYTES[wire_code] + 8))

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

    def _take_prefetched(self, table: str, uniq: np.ndarray, wire_code: int) -> Optional[tuple[np.ndarray, Versions]]:
        with self._pending_lock:
            entry = self._prefetched.pop((table, hash(uniq.tobytes()), wire_code), None)
        if entry is None or not np.array_equal(entry[0], uniq):
            return None
        try:
            return entry[1].result()
        except ShardpsError as e:
            log.warning("prefetch of %s failed (%s); pulling again", table, e)
            return None

    def _pull_unique_many(
        self, items: list[tuple[TableSpec, np.ndarray]], wire_dtype: int
    ) -> list[tuple[np.ndarray, Versions]]:
        """Rows of sorted unique ids of several tables: one call per shard (more if over the size limit)."""
        outs = [np.empty((u.shape[0], spec.dim), dtype=np.float32) for spec, u in items]
        versions: list[dict[int, int]] = [{} for _ in items]
        per_shard: list[list[tuple[int, np.ndarray, pb.PullRequest, int]]] = [[] for _ in range(self.num_shards)]
        for k, (spec, uniq) in enumerate(items):
            order, bounds = split_by_shard(uniq, self.num_shards)
            step = self._rows_per_message(spec.dim, wire_dtype)
            for s in range(self.num_shards):
                idx = order[bounds[s] : bounds[s + 1]]
                for start in range(0, idx.shape[0], step):
                    part = idx[start : start + step]
                    req = pb.PullRequest(table=spec.name, ids=codec.encode(uniq[part]), wire_dtype=wire_dtype,
                                         shard_map=self._map(s))
                    per_shard[s].append((k, part, req, len(part) * (spec.dim * _WIRE_BYTES[wire_dtype] + 8)))
        pulled = self._pulled(per_shard, "Pull", lambda reqs: pb.PullBatchRequest(pulls=reqs),
                              pb.PullBatchResponse.PULLS_FIELD_NUMBER)
        for s, k, part, rows, version in pulled:
            outs[k][part] = rows
            versions[k][s] = min(version, versions[k].get(s, version))
        return [(o, Versions(v)) for o, v in zip(outs, versions)]

    def _pulled(self, per_shard: list[list[tuple]], single: str, make_batch, field: int) -> Iterator[tuple]:
        """Run each shard's pull requests (grouped by ``_batches``) on the lanes; yield
        (shard, key, part, rows, version) per request. ``field``: the PullBatchResponse
        field that holds this kind of reply."""
        calls, metas = self._batches(per_shard, single, make_batch)
        for (s, method, _), meta, reply in zip(calls, metas, self._lane_calls(calls)):
            blocks = [reply] if method != "PullBatch" else [wire.decode_pull_response(v) for v in reply.get(field, [])]
            for (key, part), (rows, version) in zip(meta, blocks):
                yield s, key, part, rows, version

    def _batches(self, per_shard: list[list[tuple]], single: str, make_batch) -> tuple[list, list]:
        """Group each shard's requests into calls below the message limit.

        A shard with one request gets the plain RPC (``single``); more go in
        PullBatch calls. Returns the calls and, per call, the (key, part) of each entry.
        """
        calls: list[tuple[int, str, Any]] = []
        metas: list[list[tuple[int, Any]]] = []
        for s, entries in enumerate(per_shard):
            if len(entries) == 1:
                k, part, req, _ = entries[0]
                calls.append((s, single, req))
                metas.append([(k, part)])
                continue
            for group in _groups(entries, lambda e: e[3], self.max_message_bytes):
                calls.append((s, "PullBatch", make_batch([e[2] for e in group])))
                metas.append([(e[0], e[1]) for e in group])
        return calls, metas

    def pull_many(
        self, requests: dict[str, IdsLike], device: Any = None, wire_dtype: Optional[str] = None
    ) -> dict[str, tuple[torch.Tensor, Versions]]:
        """Rows of several tables in one round trip per shard: ``{table: (rows, versions)}``.

        Tables whose unique ids were prefetched (``prefetch`` / ``prefetch_many``)
        take the prefetched rows; the others are pulled together.
        """
        wire_code = self.wire_dtype if wire_dtype is None else _WIRE[wire_dtype]
        self._ssp_wait()
        prepared = {}
        for table, ids in requests.items():
            spec = self.table_spec(table)
            ids_np = _ids_to_numpy(ids)
            self._check_ids(spec, ids_np)
            if self.read_your_writes:
                self._see_own_pushes(table)
            flat = ids_np.reshape(-1)
            uniq, inverse = (flat, None) if is_sorted_unique(flat) else np.unique(flat, return_inverse=True)
            prepared[table] = (spec, ids_np.shape, uniq, inverse, self._take_prefetched(table, uniq, wire_code))
        missing = [t for t, p in prepared.items() if p[4] is None]
        pulled = dict(zip(missing, self._pull_unique_many([(prepared[t][0], prepared[t][2]) for t in missing], wire_code)))
        out = {}
        for table, (spec, shape, _, inverse, prefetched) in prepared.items():
            rows, versions = prefetched or pulled[table]
            if inverse is not None:
                rows = rows[inverse.reshape(-1)]
            t = torch.from_numpy(rows.reshape(shape + (spec.dim,)))
            out[table] = ((t.to(device, non_blocking=True) if device is not None else t), versions)
        return out

    def prefetch_many(self, requests: dict[str, IdsLike], wire_dtype: Optional[str] = None) -> Future:
        """Start pulling rows of several tables in one round trip per shard (see ``prefetch``)."""
        wire_code = self.wire_dtype if wire_dtype is None else _WIRE[wire_dtype]
        items, futures = [], []
        for table, ids in requests.items():
            spec = self.table_spec(table)
            ids_np = _ids_to_numpy(ids)
            self._check_ids(spec, ids_np)
            uniq = unique_ids(ids_np.reshape(-1))
            items.append((spec, uniq))
            f: Future = Future()
            futures.append(f)
            with self._pending_lock:
                self._prefetched[(table, hash(uniq.tobytes()), wire_code)] = (uniq, f)
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
        ids_np = _ids_to_numpy(ids)
        g = _grads_to_numpy(grads, f"{table}: grads")
        self._check_ids(spec, ids_np)
        if g.shape != ids_np.shape + (spec.dim,):
            raise InvalidArgumentError(
                f"{table}: grads must have shape {list(ids_np.shape) + [spec.dim]} (ids.shape + (dim,)), got {list(g.shape)}"
            )
        if not spec.allow_nonfinite and not np.isfinite(g).all():
            raise InvalidArgumentError(f"{table}: gradient contains NaN or Inf; push rejected")
        uniq, summed = coalesce(ids_np.reshape(-1), g.reshape(-1, spec.dim))
        wire_dtype_code = self.wire_dtype if wire_dtype is None else _WIRE[wire_dtype]
        order, bounds = split_by_shard(uniq, self.num_shards)
        step = self._rows_per_message(spec.dim, wire_dtype_code)
        sync_step = self._next_sync_step(table) if spec.sync is not None else 0
        calls = []
        for s in range(self.num_shards):
            idx = order[bounds[s] : bounds[s + 1]]
            # A synchronous worker sends every shard its part of the step, even an empty one.
            starts = list(range(0, idx.shape[0], step)) or ([0] if sync_step else [])
            for k, start in enumerate(starts):
                part = idx[start : start + step]
                req = wire.encode_push(
                    table, summed[part].reshape(len(part), spec.dim), wire_dtype_code, ids=uniq[part],
                    pulled_version=versions.by_shard.get(s) if versions is not None else None,
                    client_id=self.client_id, seq=self._next_seq(s), shard_map=self._map(s),
                    sync=pb.SyncPart(step=sync_step, rank=self.rank or 0, part=k, parts=len(starts)) if sync_step else None,
                    frame=protocol.stream_field("Push"),
                )
                calls.append((s, "Push", req))
        self._dispatch(table, calls, wait)

    def _next_sync_step(self, key: str) -> int:
        if self.rank is None:
            raise InvalidArgumentError(
                f"{key} is synchronous: the client needs its rank (RANK/WORLD_SIZE as set by torchrun, or Client(rank=...))"
            )
        self._sync_steps[key] = self._sync_steps.get(key, 0) + 1
        return self._sync_steps[key]

    def _dispatch(self, key: str, calls: list[tuple[int, str, Any]], wait: bool) -> None:
        if self.defer_pushes and not wait:
            with self._pending_lock:
                self._deferred.append((key, calls))
            return
        if self._deferred:
            self.send_pushes()  # keep this client's pushes in order
        self._submit_pushes([([key], call) for call in calls], wait)

    def send_pushes(self, pull_dense: Sequence[str] = ()) -> Optional[DensePull]:
        """Send the queued pushes (``defer_pushes``): one PushBatch per shard (or a few, below the size limit).

        ``pull_dense`` names dense tensors whose values should come back with the
        pushes: each shard reads its part once the pushes it got are applied, as a
        ``pull_dense_many`` right after them would, without a call of its own.
        Returns a ``DensePull`` holding them, or None when none were asked for or a
        shard's part would not fit in one reply (then pull them as usual).
        """
        returning = self._dense_pull(pull_dense) if pull_dense else None  # may raise: nothing is taken yet
        with self._pending_lock:
            deferred, self._deferred = self._deferred, []
        if not deferred and returning is None:
            return None
        per_shard: list[list[tuple[str, str, bytes]]] = [[] for _ in range(self.num_shards)]
        for key, calls in deferred:
            for s, method, req in calls:
                per_shard[s].append((key, method, req))
        work: list[tuple[list[str], tuple[int, str, Any]]] = []
        carries: dict[int, int] = {}  # shard -> index in work of the call carrying its dense pulls
        for s, entries in enumerate(per_shard):
            pulls = returning.requests[s] if returning is not None else []
            if len(entries) == 1 and not pulls:
                key, method, req = entries[0]
                work.append(([key], (s, method, req)))
                continue
            room = self.max_message_bytes - sum(len(p) for p in pulls)
            groups = list(_groups(entries, lambda e: len(e[2]), room)) or [[]]
            for k, group in enumerate(groups):
                tail = pulls if k == len(groups) - 1 else []
                if not group and not tail:
                    continue
                rows = [g for g in group if g[1] == "Push"]
                dense = [g for g in group if g[1] == "PushDense"]
                # Framed pushes are PushBatchRequest entries as they are (same field numbers).
                body = wire.frame(protocol.stream_field("PushBatch"), *[g[2] for g in rows + dense], *tail)
                if tail:
                    carries[s] = len(work)
                work.append(([g[0] for g in rows + dense], (s, "PushBatch", body)))
        futures = self._submit_pushes(work, wait=False)
        if returning is not None:
            returning.futures = {s: futures[i] for s, i in carries.items()}
        return returning

    def _dense_pull(self, names: Sequence[str]) -> Optional[DensePull]:
        """The PullDenseRequests (framed as PushBatchRequest.pull_dense) that bring ``names`` back with a push."""
        wire_code = self.wire_dtype
        specs = {name: self.dense_spec(name) for name in names}
        out = DensePull(specs, self.num_shards)
        sizes = [0] * self.num_shards
        for s, name, a, b, req, nbytes in self._dense_requests(specs, wire_code):
            out.requests[s].append(wire.frame(pb.PushBatchRequest.PULL_DENSE_FIELD_NUMBER, req.SerializeToString()))
            out.pieces[s].append((name, a, b))
            sizes[s] += nbytes
        if max(sizes) > self.max_message_bytes // 2:
            return None
        return out

    def _submit_pushes(self, work: list[tuple[list[str], tuple[int, str, Any]]], wait: bool) -> list[Future]:
        """Send each call on its shard's lane; ``keys`` are the tables (in entry order) it carries."""
        futures = []
        for keys, call in work:
            self._inflight.acquire()
            try:
                f = self._lanes[call[0]].submit(call[1], call[2])
            except BaseException:
                self._inflight.release()
                raise
            f.waited = wait  # type: ignore[attr-defined]  # errors of waited pushes go to the caller, not flush()
            f.keys = keys  # type: ignore[attr-defined]
            with self._pending_lock:
                for key in set(keys):
                    self._pending.setdefault(key, set()).add(f)
            f.add_done_callback(self._push_done)
            futures.append(f)
        if wait:
            for f in futures:
                f.result()
        return futures

    def _push_done(self, f: Future) -> None:
        self._inflight.release()
        keys: list[str] = f.keys  # type: ignore[attr-defined]
        with self._pending_lock:
            for key in set(keys):
                self._pending.get(key, set()).discard(f)
            if f.exception() is not None:
                if not f.waited:  # type: ignore[attr-defined]
                    self._errors.append(f.exception())  # type: ignore[arg-type]
                return
        reply = f.result()
        replies = list(reply.pushes) + list(reply.dense) if isinstance(reply, pb.PushBatchResponse) else [reply]
        for key, r in zip(keys, replies):
            if r.late or r.missing_ranks:
                self.sync_reports.append((key, list(r.missing_ranks), r.late))
                if r.late:
                    log.warning("push to %s arrived after its synchronous step was applied; dropped", key)
                else:
                    log.warning("synchronous step of %s applied without ranks %s (stragglers)", key, list(r.missing_ranks))

    def _wait_pending(self, key: Optional[str] = None) -> None:
        if self._deferred:
            self.send_pushes()
        with self._pending_lock:
            if key is None:
                waiting = [f for fs in self._pending.values() for f in fs]
            else:
                waiting = list(self._pending.get(key, ()))
        for f in waiting:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - recorded by _push_done, raised by flush()
                pass

    def flush(self) -> None:
        """Wait until every push sent so far is applied; raise the first error any of them met."""
        self._wait_pending()
        with self._pending_lock:
            errors, self._errors = self._errors, []
        if errors:
            for e in errors[1:]:
                log.error("another push failed: %s", e)
            raise errors[0]

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
        for s, start, end in self._dense_pieces(spec, pb.FLOAT32):
            req = pb.RegisterDenseRequest(
                spec=msg, row_start=start, values=codec.encode(rows2d[start:end]), shard_map=self._map(s)
            )
            calls.append((s, "RegisterDense", req))
        # Every shard learns the spec (so any can describe it), also those owning no rows.
        for s in sorted(set(range(self.num_shards)) - {c[0] for c in calls}):
            calls.append((s, "RegisterDense", pb.RegisterDenseRequest(spec=msg, shard_map=self._map(s))))
        results = self._fan_out(calls)
        self._dense[name] = spec
        return any(r.created for r in results)

    def _dense_pieces(self, spec: DenseSpec, wire_code: int) -> Iterable[tuple[int, int, int]]:
        step = self._rows_per_message(spec.cols, wire_code)
        for s, start, end in dense_row_ranges(spec.name, spec.rows, spec.chunk_rows, self.num_shards):
            for a in range(start, end, step):
                yield s, a, min(a + step, end)

    def dense_spec(self, name: str) -> DenseSpec:
        spec = self._dense.get(name)
        if spec is None:
            info = self._call(0, "DescribeTable", pb.DescribeTableRequest(name=name))
            if not info.HasField("dense"):
                raise InvalidArgumentError(f"{name!r} is a table, not a dense tensor")
            spec = self._dense[name] = dense_spec_from_pb(info.dense)
        return spec

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
        wire_code = self.wire_dtype if wire_dtype is None else _WIRE[wire_dtype]
        self._ssp_wait()
        specs = {name: self.dense_spec(name) for name in names}
        if self.read_your_writes:
            for name in names:
                self._see_own_pushes(name)
        per_shard: list[list[tuple]] = [[] for _ in range(self.num_shards)]
        for s, name, a, b, req, nbytes in self._dense_requests(specs, wire_code):
            per_shard[s].append((name, (a, b), req, nbytes))
        pulled = self._pulled(per_shard, "PullDense", lambda reqs: pb.PullBatchRequest(dense=reqs),
                              pb.PullBatchResponse.DENSE_FIELD_NUMBER)
        return _dense_values(specs, ((s, name, a, b, block, version) for s, name, (a, b), block, version in pulled))

    def _dense_requests(self, specs: dict[str, DenseSpec], wire_code: pb.DType) -> Iterator[tuple]:
        """The PullDenseRequests reading ``specs`` whole: (shard, name, row_start, row_end, request, reply bytes)."""
        for name, spec in specs.items():
            for s, a, b in self._dense_pieces(spec, wire_code):
                req = pb.PullDenseRequest(name=name, row_start=a, row_end=b, wire_dtype=wire_code, shard_map=self._map(s))
                yield s, name, a, b, req, (b - a) * spec.cols * _WIRE_BYTES[wire_code]

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
        if tuple(g.shape) != spec.shape:
            raise InvalidArgumentError(f"{name}: grad must have shape {list(spec.shape)}, got {list(g.shape)}")
        if not spec.allow_nonfinite and not np.isfinite(g).all():
            raise InvalidArgumentError(f"{name}: gradient contains NaN or Inf; push rejected")
        g2 = g.reshape(spec.rows, spec.cols)
        wire_dtype_code = self.wire_dtype if wire_dtype is None else _WIRE[wire_dtype]
        sync_step = self._next_sync_step(name) if spec.sync is not None else 0
        pieces = list(self._dense_pieces(spec, wire_dtype_code))
        per_shard = collections.Counter(s for s, _, _ in pieces)
        seen: collections.Counter = collections.Counter()
        calls = []
        for s, a, b in pieces:
            req = wire.encode_push(
                name, g2[a:b], wire_dtype_code, row_start=a,
                pulled_version=versions.by_shard.get(s) if versions is not None else None,
                client_id=self.client_id, seq=self._next_seq(s), shard_map=self._map(s),
                sync=pb.SyncPart(step=sync_step, rank=self.rank or 0, part=seen[s], parts=per_shard[s]) if sync_step else None,
                frame=protocol.stream_field("PushDense"),
            )
            seen[s] += 1
            calls.append((s, "PushDense", req))
        self._dispatch(name, calls, wait)

    # ---- cluster operations ----------------------------------------------------------

    def checkpoint(self, checkpoint_id: Optional[str] = None, hold_s: float = 30.0) -> str:
        """Checkpoint every shard at one consistent point; returns the checkpoint id.

        Flushes this client's pushes, then runs a two-phase checkpoint: every
        shard holds new pushes back (PREPARE), then every shard copies its state
        and resumes (COMMIT) before writing its file. If any shard fails to
        prepare, the others are released (ABORT) and the error is raised.
        """
        self.flush()
        cid = checkpoint_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        shards = range(self.num_shards)
        phase = pb.CheckpointRequest.Phase
        try:
            self._fan_out([(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id=cid, phase=phase.PREPARE, hold_s=hold_s))
                           for s in shards])
        except ShardpsError:
            for s in shards:
                try:
                    self._call(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id=cid, phase=phase.ABORT), retry=False)
                except ShardpsError as e:
                    log.warning("abort of checkpoint %s on %s failed: %s", cid, self.addresses[s], e)
            raise
        self._fan_out([(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id=cid, phase=phase.COMMIT)) for s in shards])
        return cid

    def close(self) -> None:
        """Flush pending pushes (errors are logged) and close the channels."""
        if self._closed:
            return
        try:
            self.flush()
        except ShardpsError as e:
            log.error("pending push failed at close: %s", e)
        finally:
            self._stop.set()
            if self._heartbeat_thread is not None:
                self._heartbeat_thread.join()
                try:
                    self._heartbeat(leaving=True)
                except ShardpsError as e:
                    log.debug("leaving heartbeat failed: %s", e)
            self._closed = True
            self._pool.shutdown(wait=True)
            for lane in self._lanes:
                lane.close()
            for ch in self._channels:
                ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DensePull:
    """Dense values coming back with a step's pushes (``Client.send_pushes(pull_dense=...)``).

    ``result()`` waits for the pushes that carry them and returns what
    ``pull_dense_many`` returns; it raises the error of a push that failed.
    """

    def __init__(self, specs: dict[str, DenseSpec], num_shards: int) -> None:
        self.specs = specs
        self.requests: list[list[bytes]] = [[] for _ in range(num_shards)]  # framed, per shard
        self.pieces: list[list[tuple[str, int, int]]] = [[] for _ in range(num_shards)]  # (name, rows) per request
        self.futures: dict[int, Future] = {}

    def done(self) -> bool:
        """True once every shard has answered (``result()`` will not wait)."""
        return all(f.done() for f in self.futures.values())

    def result(self) -> dict[str, tuple[torch.Tensor, Versions]]:
        return _dense_values(self.specs, self._blocks())

    def _blocks(self) -> Iterator[tuple]:
        for s, f in self.futures.items():
            replies = list(f.result().pulled_dense)
            if len(replies) != len(self.pieces[s]):
                raise ShardpsError(f"shard {s} answered {len(replies)} of {len(self.pieces[s])} dense pulls sent "
                                   "with its pushes (a server without PushBatch.pull_dense?)")
            for (name, a, b), r in zip(self.pieces[s], replies):
                yield s, name, a, b, codec.decode(r.rows, f"{name}: rows").reshape(b - a, self.specs[name].cols), r.version


def _dense_values(specs: dict[str, DenseSpec], blocks: Iterable[tuple]) -> dict[str, tuple[torch.Tensor, Versions]]:
    """Whole dense tensors from (shard, name, row_start, row_end, rows, version) blocks: ``{name: (value, versions)}``."""
    outs = {name: np.empty((spec.rows, spec.cols), dtype=np.float32) for name, spec in specs.items()}
    versions: dict[str, dict[int, int]] = {name: {} for name in specs}
    for s, name, a, b, rows, version in blocks:
        outs[name][a:b] = rows
        v = versions[name]
        v[s] = min(version, v.get(s, version))
    return {
        name: (torch.from_numpy(outs[name].reshape(spec.shape)), Versions(versions[name]))
        for name, spec in specs.items()
    }


def _groups(entries: list, size_of: Callable[[Any], int], limit: int) -> Iterator[list]:
    """Consecutive runs of ``entries`` whose sizes add up to at most ``limit`` (a larger entry goes alone)."""
    group: list = []
    size = 0
    for entry in entries:
        n = size_of(entry)
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(entry)
        size += n
    if group:
        yield group


def _results(getters: list[Callable[[], Any]]) -> list[Any]:
    """Every getter's result, in order; once all have finished, raise the first ShardpsError any raised."""
    results, first_error = [], None
    for get in getters:
        try:
            results.append(get())
        except ShardpsError as e:
            first_error = first_error or e
            results.append(None)
    if first_error is not None:
        raise first_error
    return results


class _Stub:
    """A callable per method, with the protocol table's (de)serializers (wire-level for the bulk methods)."""

    def __init__(self, channel: grpc.Channel) -> None:
        for m in protocol.METHODS.values():
            if not m.streaming:
                setattr(self, m.name, channel.unary_unary(m.path, request_serializer=m.encode_request,
                                                          response_deserializer=m.decode_reply))


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={raw!r} is not an integer") from None


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


__all__ = ["Client", "DensePull", "Versions"]

