"""The shardps client: routes ids to shards, fans out in parallel, reassembles.

Usage::

    from shardps_client import Client, Adam
    with Client(["127.0.0.1:7000", "127.0.0.1:7001"]) as c:
        c.create_table("user", num_embeddings=1_000_000, dim=64, optimizer=Adam(lr=1e-3))
        rows = c.pull("user", ids)      # ids.shape + (64,)
        c.push("user", ids, grads)      # duplicate ids summed
        c.flush()                       # every push so far applied

``Client`` is a thin facade over parts with one job each: ``transport``
(channels, deadlines, retries, lanes; the only module that imports grpc),
``planner`` (pure functions that split requests by shard and size and
reassemble replies), ``pushes`` (the push pipeline), ``worker`` (heartbeats,
SSP clock, barrier), ``admin`` (spec cache, shard map, checkpoints),
``session`` (what the parts share), ``pulls`` (pulls, read-your-writes,
prefetches), ``cached_tables`` (row caches, pushes of table rows), ``dense``
(dense tensors), ``cluster`` (tables, checkpoints, exports, state dicts) and
``inputs`` (user inputs as checked numpy arrays).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from shardps.core import kernels
from shardps.core.memory import tune_malloc
from shardps.core.specs import TableSpec
from shardps.core.tokens import token_from_environment
from shardps_client.admin import Catalog
from shardps_client.cache import CacheStats
from shardps_client.cached_tables import CachedTables
from shardps_client.cluster import ClusterMethods, ClusterOps
from shardps_client.dense import DenseMethods, DenseTensors
from shardps_client.errors import InvalidArgumentError, ShardpsError
from shardps_client.inputs import IdsLike, MiB, check_client_options, wire_code
from shardps_client.pulls import Pulls
from shardps_client.pushes import DensePull, PushHold, PushPipeline
from shardps_client.session import Session, Shared
from shardps_client.threads import check_setting, set_torch_threads
from shardps_client.transport import TLS, Transport
from shardps_client.versions import Versions
from shardps_client.worker import WorkerClock

log = logging.getLogger(__name__)


class Client(ClusterMethods, DenseMethods):
    """A connection to every shard of a cluster.

    Args:
        addresses: shard addresses ("host:port"); list position = shard index,
            checked against each shard on connect. A shard run as a replica group is its members' addresses joined
            by "|" ("host:port|host:port|..."; "," too): calls go to its primary, found again after a failover.
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
            streams) the pull first waits for them. With False, an asynchronous
            push to a table without synchronous steps waits for the next pull and
            leaves right after its calls (the shards apply it off the step's path),
            or at flush, close, a push with wait=True, or past 64 waiting calls.
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
            when shards run on this machine (a loopback address, or a shard whose
            ShardInfo says it runs under this kernel: another network namespace or
            container here; with ``check_shard_map=False`` no ShardInfo is asked, so only
            loopback addresses count) and neither OMP_NUM_THREADS nor an earlier
            ``torch.set_num_threads`` chose otherwise, one thread per core those
            shards leave free (at least 1), because torch's idle threads spin and take
            the shards' cores. An int: that many. None: leave torch alone.
        tls: TLS to the shards (``TLS(ca, cert=None, key=None)``; files). None: TLS from
            SHARDPS_TLS_CA / SHARDPS_TLS_CLIENT_CERT / SHARDPS_TLS_CLIENT_KEY when set, else plaintext.
        token: the bearer token every call carries; None: the file SHARDPS_TOKEN_FILE names, else
            SHARDPS_TOKEN, else no token (what shards without ``--tokens-file`` expect).
        data_plane: how pulls and pushes travel: "zmq" (the default; SHARDPS_DATA_PLANE sets another): over
            a shard's data plane (ZeroMQ) when it has one, else on a gRPC stream; a shard on this machine (in this
            network namespace) is reached over a Unix socket, others over TCP; "zmq-tcp": the data plane always
            over TCP; "grpc": on a gRPC stream per shard. All keep the same order, retries and errors.
        stale_reads: pulls of a shard run as a replica group go to one of its backups, which answers with rows as
            of the log records it has applied (behind its primary by its replication lag; this client's own pushes
            may not show yet): reads spread over the group and go on while a failover elects a primary. Pushes
            always go to the primary. Default False: every call goes to the primary.
    """

    def __init__(
        self, addresses: Sequence[str], *, timeout: float = 30.0, retry_timeout: float = 30.0,
        wire_dtype: str = "float32", max_message_bytes: int = 4 * MiB - 64 * 1024, max_inflight_pushes: int = 32,
        read_your_writes: bool = True, check_shard_map: bool = True, client_id: Optional[str] = None,
        rank: Optional[int] = None, world_size: Optional[int] = None, ssp_bound: Optional[int] = None,
        heartbeat_s: float = 1.0, torch_threads: Union[int, str, None] = "auto", tls: Optional[TLS] = None,
        token: Optional[str] = None, data_plane: Optional[str] = None, stale_reads: bool = False,
    ) -> None:
        check_client_options(addresses, timeout, retry_timeout, max_message_bytes, max_inflight_pushes, heartbeat_s)
        if not addresses:
            raise InvalidArgumentError("Client needs at least one shard address")
        code = wire_code(wire_dtype)
        tune_malloc()  # message-sized buffers stay in the heap (see shardps.core.memory)
        kernels.jit()  # the compiled kernels load now (about 10 ms), not in the first pull
        check_setting(torch_threads)  # (applied once the shards said where they run)
        addresses, max_message_bytes = list(addresses), int(max_message_bytes)
        client_id = client_id or uuid.uuid4().hex
        transport = Transport(addresses, timeout, retry_timeout, max_message_bytes,
                              tls if tls is not None else TLS.from_environment(),
                              token if token is not None else token_from_environment(),
                              data_plane or os.environ.get("SHARDPS_DATA_PLANE") or "zmq", client_id, stale_reads)
        n = len(addresses)
        pool = ThreadPoolExecutor(max_workers=max(4, 4 * n), thread_name_prefix="shardps-client")
        self._closed = True  # until made: a client refused here (a rank, a shard map, a token) leaves nothing running
        worker: Optional[WorkerClock] = None
        made: list[Session] = []  # (the heartbeats' shards come from the session: no thread holds this client)
        try:
            pushes = PushPipeline(transport, n, max_message_bytes, max_inflight_pushes)
            worker = WorkerClock(transport, lambda: made[0].active_shards(), rank, world_size, ssp_bound, pool.submit)
            self._session = Session(addresses, timeout, retry_timeout, code, max_message_bytes, read_your_writes,
                                    client_id, transport, Catalog(transport), pushes, worker, pool)
            made.append(self._session)
            pushes.replan, pushes.run_async = self._session.replan, pool.submit
            self._caches = CachedTables(self._session)
            self._pulls = Pulls(self._session, self._caches)
            self._dense = DenseTensors(self._session)
            self._cluster = ClusterOps(self._session, self.flush, self.pull)
            self._hold: Optional[PushHold] = None  # defer_pushes
            infos = []
            if check_shard_map:
                infos = self.check_shard_map()
                for lane in transport.lanes:  # every shard answered: the data planes' connections made as we go on
                    getattr(lane, "open", lambda: None)()
            set_torch_threads(torch_threads, addresses, infos)
            worker.start(heartbeat_s)
            self._unclosed = weakref.finalize(self, _collected, self._session, self._caches)
            self._unclosed.atexit = False  # (at exit, as before: what a client never closed left unflushed is lost)
            self._closed = False
        except BaseException:
            if worker is not None:
                worker.stop()
            pool.shutdown(wait=True)
            transport.close()
            raise

    @classmethod
    def from_file(cls, path: str, **kwargs: Any) -> Client:
        """Connect to the cluster described by a cluster file (written by ``shardps cluster``): its
        addresses (with replica groups, ``"groups"``: each shard's members, of which calls reach the primary), and its
        TLS files (``"tls": {"ca", "cert", "key"}``, paths) when it has them."""
        with open(path) as f:
            data = json.load(f)
        if data.get("tls") and "tls" not in kwargs:
            kwargs["tls"] = TLS(**data["tls"])
        groups = data.get("groups")
        return cls(["|".join(g) for g in groups] if groups else data["addresses"], **kwargs)

    # ---- the parts' state, as attributes of the client ----------------------------------

    addresses: Shared[list[str]] = Shared("shard addresses, in shard index order")
    num_shards = property(lambda self: self._session.num_shards, doc="number of shards")
    timeout: Shared[float] = Shared("deadline in seconds of every call")
    retry_timeout: Shared[float] = Shared("how long calls keep retrying an UNAVAILABLE shard")
    wire_dtype: Shared[int] = Shared("the default wire dtype's code (planner.WIRE)")
    max_message_bytes: Shared[int] = Shared("requests and replies are split to stay below this")
    read_your_writes: Shared[bool] = Shared("a pull of a table sees this client's earlier pushes to it")
    client_id: Shared[str] = Shared("identity for exactly-once pushes")
    transport: Shared[Transport] = Shared("channels, stubs and lanes to every shard (``Transport``)")
    catalog: Shared[Catalog] = Shared("specs of the tables and dense tensors this client uses (``admin.Catalog``)")
    pushes: Shared[PushPipeline] = Shared("queued and in-flight pushes (``PushPipeline``)")
    worker: Shared[WorkerClock] = Shared("heartbeats, SSP clock, barrier (``WorkerClock``)")
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

    def hold_pushes(self, step: bool = False) -> PushHold:
        """A handle that queues this client's asynchronous pushes while held; ``send()`` sends them as one
        PushBatch per shard (``send_pushes``), ``release()`` stops holding. ``ShardedOptimizer`` holds one, with
        ``step``: the row pushes made while it is held are one optimizer step, each table's summed per row first."""
        return self.pushes.hold(self.send_pushes, step)

    # ---- workers: heartbeats, SSP clocks ---------------------------------------------

    def advance_clock(self, steps: int = 1) -> int:
        """Mark the end of a training step (the SSP clock), or of ``steps`` (a worker started again from a checkpoint
        of step N resumes its clock with N: a new client's starts at 0); returns the new clock."""
        return self.worker.advance(steps)

    def barrier(self, timeout: float = 600.0) -> None:
        """Wait until every live worker's clock has reached this worker's clock.

        Workers that left (closed their client) or went silent are not waited
        for. Raises ShardTimeoutError after ``timeout`` seconds.
        """
        self.worker.barrier(timeout)

    # ---- tables ----------------------------------------------------------------------

    def table_spec(self, name: str) -> TableSpec:
        """The spec of a table (asked of shard 0 the first time, then cached)."""
        return self.catalog.table(name)

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

    def pull_many(
        self, requests: dict[str, IdsLike], device: Any = None, wire_dtype: Optional[str] = None
    ) -> dict[str, tuple[torch.Tensor, Versions]]:
        """Rows of several tables in one round trip per shard: ``{table: (rows, versions)}``.

        Tables whose unique ids were prefetched (``prefetch`` / ``prefetch_many``)
        take the prefetched rows; the others are pulled together.
        """
        return self._pulls.pull_many(requests, device, wire_dtype)

    def prefetch_many(self, requests: dict[str, IdsLike], wire_dtype: Optional[str] = None,
                      steps_ahead: int = 1) -> Future:
        """Start pulling rows of several tables in one round trip per shard (see ``prefetch``).

        ``steps_ahead``: the rows are for the pull that many pulls of the table from now (``Prefetcher``
        passes its depth + 1); a row cache (``cache_table``) uses it to tell which rows it will serve then.
        """
        return self._pulls.prefetch_many(requests, wire_dtype, steps_ahead)

    def push(self, table: str, ids: IdsLike, grads: Union[torch.Tensor, np.ndarray],
             versions: Optional[Versions] = None, wait: bool = False, wire_dtype: Optional[str] = None) -> None:
        """Send gradients of ``ids`` (grads: ids.shape + (dim,)); duplicate ids are summed.

        Asynchronous: returns once the push is queued; a client's pushes reach
        each shard in the order they were made. ``flush()`` waits for them and
        raises any error a shard reported. ``versions`` (from
        ``pull_with_version``) lets shards compute staleness; ``wait=True``
        blocks until applied.
        """
        self._caches.push(table, ids, grads, versions, wait, wire_dtype)

    def push_stacked(self, tables: Sequence[str], ids: Sequence[IdsLike], grads: Union[torch.Tensor, np.ndarray],
                     versions: Optional[Sequence[Optional[Versions]]] = None, wire_dtype: Optional[str] = None) -> None:
        """``push`` of several tables of one width at once: ``ids[t]`` the ids of ``tables[t]``, ``grads`` their
        gradients stacked in that order (``[sum of len(ids[t]), dim]``), ``versions[t]`` as ``push`` takes.

        Checked as ``push`` checks (one error names the table). Tables whose ids are sorted and unique (what a
        collection pulls) and that have neither a row cache nor a synchronous step are planned together, one
        framed push per table and shard, dispatched at once; the others take ``push``'s path.
        """
        self._caches.push_stacked(tables, ids, grads, versions if versions is not None else [None] * len(tables),
                                  wire_dtype)

    def send_pushes(self, pull_dense: Sequence[str] = (), park: bool = False) -> Optional[DensePull]:
        """Send the queued pushes (``defer_pushes``): one PushBatch per shard (or a few, below the size limit).

        ``pull_dense`` names dense tensors whose values should come back with the
        pushes: each shard reads its part once the pushes it got are applied, as a
        ``pull_dense_many`` right after them would, without a call of its own.
        Returns a ``DensePull`` holding them, or None when none were asked for or a
        shard's part would not fit in one reply (then pull them as usual).
        """
        returning = self._dense.returning(pull_dense) if pull_dense else None  # may raise: nothing is taken yet
        return self.pushes.park(returning) if park else self.pushes.send(returning)

    def flush(self) -> None:
        """Push what the row caches summed (emptying them), wait until every push sent so far is applied, and
        raise the first error any of them met."""
        self._caches.drain_all()
        self.pushes.flush()

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
        self._caches.configure(table, steps, max_rows)

    def cache_stats(self, table: str) -> Optional[CacheStats]:
        """Counters of ``table``'s row cache (None when it has none)."""
        return self._caches.stats(table)

    def close(self) -> None:
        """Flush pending pushes (errors are logged) and close the channels."""
        if not self._closed:
            self._closed = True
            self._unclosed.detach()
            _close(self._session, self._caches)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(session: Session, caches: CachedTables) -> None:
    """What ``Client.close`` does: the caches' sums pushed, every push waited for (errors logged), the heartbeats
    stopped, the channels closed."""
    try:
        caches.drain_all()
        session.pushes.flush()
    except ShardpsError as e:
        log.error("pending push failed at close: %s", e)
    finally:
        session.worker.stop()
        session.pool.shutdown(wait=True)
        session.transport.close()


def _collected(session: Session, caches: CachedTables) -> None:
    """A client collected without ``close()``: closed as ``close()`` would, in a thread of its own (a finalizer runs
    wherever the collector does, and the flush waits on the network), so its threads and connections do not outlive
    it."""
    log.warning("a shardps Client was collected without close(): its pushes are flushed and its connections closed "
                "now (use `with Client(...)` or close())")

    def close() -> None:
        try:
            _close(session, caches)
        except Exception as e:  # noqa: BLE001 - nobody to raise to
            log.error("closing a collected Client: %s: %s", type(e).__name__, e)
    threading.Thread(target=close, name="shardps-client-close", daemon=True).start()


__all__ = ["Client", "DensePull", "MiB", "PushHold", "Versions"]
