"""Prometheus metrics of a shard: ``shardps serve --metrics-port`` serves them at ``/metrics``.

Made with the standard client library (``prometheus_client``), one registry per shard. The shard's
parts report to a ``Metrics`` object they are given at construction; without ``--metrics-port`` they
are given ``NO_METRICS``, whose methods do nothing, so a shard that is not scraped pays one no-op
call per event.

Counters and histograms (all prefixed ``shardps_``):

- ``requests_total{method}``, ``request_bytes_total{method}``, ``response_bytes_total{method}``,
  ``request_seconds{method}`` (histogram; the handler's time, gRPC's own work excluded): every call,
  stream frames under the method they carry (Pull, Push, PullBatch, ...).
- ``errors_total{method,code}``: calls refused, by gRPC status code.
- ``rows_total{table,op}`` and ``bytes_total{table,op}`` (op: pull, push): rows read and updated and
  their float32 payload, per table.
- ``push_staleness`` (histogram): versions between a push's pull and its apply.
- ``wal_fsync_seconds`` and ``wal_group_records`` (histograms): each write-ahead-log fsync and how
  many records it made durable at once (group commit).
- ``checkpoint_seconds`` and ``checkpoint_pause_seconds`` (histograms): a checkpoint's whole
  duration and the time pushes waited for its copy.
- ``sync_wait_seconds`` (histogram): how long a synchronous step's completing push waited for the
  step; ``sync_missing_workers_total``: workers a step went on without (gone, dropped from it).

Read at each scrape: ``clients{transport}`` (connections that pulled or pushed in the last minute, by
transport: zmq, zmq-ipc, grpc-stream, grpc-unary), ``data_plane_handoffs_total`` (data-plane calls that waited off
their socket's thread), ``version``, ``uptime_seconds``, ``table_rows{table}`` and
``table_bytes{table}`` (stored rows and bytes of memory), ``live_workers``, ``gone_workers``; for bounded
tables ``table_admitted_total{table}``, ``table_rejected_total{table}`` (pushed rows of ids not admitted),
``table_evicted_total{table,cause}`` (cause: ttl, capacity) and ``table_sketch_bytes{table}``; tables with a disk
tier ``table_tier_rows{table,tier}`` (memory, disk), ``table_disk_bytes{table}``,
``table_tier_lookups_total{table,result}`` (hit, miss) and ``table_tier_rows_moved_total{table,direction}``
(promoted, written_back); members of a replica group ``replica_role{role}``, ``replica_epoch``, ``replica_lsn`` and,
on the primary, ``replica_backup_lag{member}``; live resharding's ``slot_map_epoch``, ``slots_owned`` and
``migrations_in_flight{role,state}`` (source: copying, frozen, committing; target: receiving, prepared).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from shardps.server.rpc.peers import Peers
from shardps.server.shard.metrics import NullMetrics

if TYPE_CHECKING:
    from shardps.server.shard.facade import Shard

# Handler latencies: 50 us to 10 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
GROUP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CHECKPOINT_BUCKETS = (1e-3, 1e-2, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)




class Metrics(NullMetrics):
    """A shard's metrics in a registry of its own (several shards may share a process in tests)."""

    enabled = True

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter("shardps_requests", "Calls served, by method", ["method"], registry=r)
        self._request_bytes = Counter("shardps_request_bytes", "Request bytes, by method", ["method"], registry=r)
        self._response_bytes = Counter("shardps_response_bytes", "Response bytes, by method", ["method"], registry=r)
        self._latency = Histogram("shardps_request_seconds", "Handler time of a call, by method", ["method"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self._errors = Counter("shardps_errors", "Calls refused, by method and gRPC status code", ["method", "code"],
                               registry=r)
        self._rows = Counter("shardps_rows", "Rows pulled or pushed, by table", ["table", "op"], registry=r)
        self._bytes = Counter("shardps_bytes", "Float32 payload of the rows pulled or pushed, by table",
                              ["table", "op"], registry=r)
        self._staleness = Histogram("shardps_push_staleness", "Versions between a push's pull and its apply",
                                    buckets=STALENESS_BUCKETS, registry=r)
        self._fsync = Histogram("shardps_wal_fsync_seconds", "Write-ahead-log write and fsync time",
                                buckets=LATENCY_BUCKETS, registry=r)
        self._group = Histogram("shardps_wal_group_records", "Records made durable by one fsync (group commit)",
                                buckets=GROUP_BUCKETS, registry=r)
        self._ckpt = Histogram("shardps_checkpoint_seconds", "Checkpoint duration", buckets=CHECKPOINT_BUCKETS,
                               registry=r)
        self._ckpt_pause = Histogram("shardps_checkpoint_pause_seconds", "Time pushes waited for a checkpoint's copy",
                                     buckets=CHECKPOINT_BUCKETS, registry=r)
        self._sync_wait = Histogram("shardps_sync_wait_seconds", "Wait of a synchronous step's completing push",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self._sync_missing = Counter("shardps_sync_missing_workers", "Workers synchronous steps went on without",
                                     registry=r)
        # Label children, bound once: a labels() lookup per event would cost more than the event's update.
        self._per_method: dict[str, tuple[Any, Any, Any, Any]] = {}
        self._per_table: dict[str, tuple[Any, Any, Any, Any]] = {}
        self._lock = threading.Lock()
        self._http: Optional[Any] = None

    def _method(self, method: str) -> tuple[Any, Any, Any, Any]:
        m = self._per_method.get(method)
        if m is None:
            with self._lock:
                m = self._per_method[method] = (self._requests.labels(method), self._request_bytes.labels(method),
                                                self._response_bytes.labels(method), self._latency.labels(method))
        return m

    def _table(self, table: str) -> tuple[Any, Any, Any, Any]:
        t = self._per_table.get(table)
        if t is None:
            with self._lock:
                t = self._per_table[table] = (self._rows.labels(table, "pull"), self._bytes.labels(table, "pull"),
                                              self._rows.labels(table, "push"), self._bytes.labels(table, "push"))
        return t

    def call(self, method: str, seconds: float, request_bytes: int, response_bytes: int) -> None:
        requests, req_bytes, resp_bytes, latency = self._method(method)
        requests.inc()
        req_bytes.inc(request_bytes)
        resp_bytes.inc(response_bytes)
        latency.observe(seconds)

    def error(self, method: str, code: str) -> None:
        self._errors.labels(method, code).inc()

    def pulled(self, table: str, rows: int, row_bytes: int) -> None:
        r, b, _, _ = self._table(table)
        r.inc(rows)
        b.inc(rows * row_bytes)

    def pushed(self, table: str, rows: int, row_bytes: int, staleness: int) -> None:
        _, _, r, b = self._table(table)
        r.inc(rows)
        b.inc(rows * row_bytes)
        self._staleness.observe(staleness)

    def wal_flush(self, seconds: float, records: int) -> None:
        self._fsync.observe(seconds)
        self._group.observe(records)

    def checkpoint(self, seconds: float, pause: float) -> None:
        self._ckpt.observe(seconds)
        self._ckpt_pause.observe(pause)

    def sync_step(self, waited: float, missing: int) -> None:
        self._sync_wait.observe(waited)
        if missing:
            self._sync_missing.inc(missing)

    def watch(self, shard: Shard) -> None:
        """Add the values read at each scrape (version, tables, workers) of ``shard``."""
        self.registry.register(_ShardCollector(shard))

    def watch_transports(self, peers: Peers, data_plane: Optional[Any]) -> None:
        """Add the data path's connections by transport (and the data plane's handoffs, when it has one)."""
        self.registry.register(_TransportCollector(peers, data_plane))

    def watch_replica(self, info: Callable[[], dict[str, Any]]) -> None:
        """Add a replica group member's role, epoch, log and its backups' lag (``info()``: ``ReplicaMember.info``)."""
        self.registry.register(_ReplicaCollector(info))

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` (0: a free port) in a daemon thread; the port."""
        from prometheus_client import start_http_server

        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _TransportCollector:
    """The data path's connections by transport, read when Prometheus scrapes."""

    def __init__(self, peers: Peers, data_plane: Optional[Any]) -> None:
        self.peers, self.data_plane = peers, data_plane

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        clients = GaugeMetricFamily("shardps_clients", "Connections that pulled or pushed in the last minute, "
                                    "by transport", labels=["transport"])
        for transport, n in self.peers.by_transport().items():
            clients.add_metric([transport], n)
        yield clients
        yield CounterMetricFamily("shardps_data_plane_handoffs", "Data-plane calls that waited off their "
                                  "socket's thread", value=self.data_plane.handoffs if self.data_plane else 0)


class _ReplicaCollector:
    """A replica group member's place in it, read when Prometheus scrapes."""

    def __init__(self, info: Callable[[], dict[str, Any]]) -> None:
        self.info = info

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        r = self.info()
        role = GaugeMetricFamily("shardps_replica_role", "1 for this member's role in its replica group",
                                 labels=["role"])
        for name in ("primary", "backup", "candidate"):
            role.add_metric([name], 1.0 if r["role"] == name else 0.0)
        yield role
        yield GaugeMetricFamily("shardps_replica_epoch", "The epoch of the primary this member is or follows",
                                value=r["epoch"])
        yield GaugeMetricFamily("shardps_replica_lsn", "Records in this member's log (its log sequence number)",
                                value=r["lsn"])
        lag = GaugeMetricFamily("shardps_replica_backup_lag", "On the primary: records each backup lacks",
                                labels=["member"])
        for member, lsn in r["backups"].items():
            lag.add_metric([member], r["lsn"] - lsn)
        yield lag


class _ShardCollector:
    """Gauges read from the shard when Prometheus scrapes."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def describe(self) -> list[Any]:
        return []  # gauges made at collect time; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        info = self.shard.info()
        yield GaugeMetricFamily("shardps_version", "Pushes applied since the shard's state began", value=info.version)
        yield GaugeMetricFamily("shardps_uptime_seconds", "Seconds since the shard started",
                                value=time.monotonic() - self.shard.started)
        rows = GaugeMetricFamily("shardps_table_rows", "Rows stored, by table", labels=["table"])
        nbytes = GaugeMetricFamily("shardps_table_bytes", "Memory of a table (rows, optimizer state, index)",
                                   labels=["table"])
        admitted = CounterMetricFamily("shardps_table_admitted", "Rows admitted by a push since start", labels=["table"])
        rejected = CounterMetricFamily("shardps_table_rejected", "Pushed rows of ids not (yet) admitted since start",
                                       labels=["table"])
        evicted = CounterMetricFamily("shardps_table_evicted", "Rows evicted since start, by cause",
                                      labels=["table", "cause"])
        sketch = GaugeMetricFamily("shardps_table_sketch_bytes", "Memory of a table's admission sketch",
                                   labels=["table"])
        tier_rows = GaugeMetricFamily("shardps_table_tier_rows", "Rows of a table with a disk tier, by tier (memory: "
                                      "rows held in RAM; disk: rows the disk tier holds)", labels=["table", "tier"])
        disk_bytes = GaugeMetricFamily("shardps_table_disk_bytes", "Bytes a table's rows take on disk",
                                       labels=["table"])
        lookups = CounterMetricFamily("shardps_table_tier_lookups", "Rows requests looked for in memory since start, "
                                      "by result (hit, miss)", labels=["table", "result"])
        moved = CounterMetricFamily("shardps_table_tier_rows_moved", "Rows moved between memory and disk since start "
                                    "(promoted: read back; written_back: written as they left memory)",
                                    labels=["table", "direction"])
        for t in info.tables:
            rows.add_metric([t.spec.name], t.num_rows)
            if getattr(t.spec, "disk", None) is not None:
                tier_rows.add_metric([t.spec.name, "memory"], t.hot_rows)
                tier_rows.add_metric([t.spec.name, "disk"], t.disk_rows)
                disk_bytes.add_metric([t.spec.name], t.disk_bytes)
                lookups.add_metric([t.spec.name, "hit"], t.tier_hits)
                lookups.add_metric([t.spec.name, "miss"], t.tier_misses)
                moved.add_metric([t.spec.name, "promoted"], t.promoted)
                moved.add_metric([t.spec.name, "written_back"], t.written_back)
            nbytes.add_metric([t.spec.name], t.bytes)
            if getattr(t.spec, "bounded", False):
                admitted.add_metric([t.spec.name], t.admitted)
                rejected.add_metric([t.spec.name], t.rejected)
                evicted.add_metric([t.spec.name, "ttl"], t.evicted_ttl)
                evicted.add_metric([t.spec.name, "capacity"], t.evicted_capacity)
                sketch.add_metric([t.spec.name], t.sketch_bytes)
        yield from (rows, nbytes, admitted, rejected, evicted, sketch, tier_rows, disk_bytes, lookups, moved)
        _, live, gone = self.shard.membership.status()
        yield GaugeMetricFamily("shardps_live_workers", "Training workers heard from recently", value=len(live))
        yield GaugeMetricFamily("shardps_gone_workers", "Workers silent for longer than --worker-timeout",
                                value=len(gone))
        slots = self.shard.slots
        yield GaugeMetricFamily("shardps_slot_map_epoch", "The epoch of this shard's slot map (+1 per committed "
                                "slot migration in the cluster it has installed)", value=slots.map.epoch)
        yield GaugeMetricFamily("shardps_slots_owned", "Hash slots (of 16,384) this shard owns, a split slot counted "
                                "once", value=int(slots.map.holds(self.shard.index).sum()))
        moving = GaugeMetricFamily("shardps_migrations_in_flight", "Slot migrations in flight here, by role and state",
                                   labels=["role", "state"])
        counts: dict[tuple[str, str], int] = {}
        for mv in self.shard.migrations.in_flight():
            counts[(mv["role"], mv["state"])] = counts.get((mv["role"], mv["state"]), 0) + 1
        for (role, state), n in sorted(counts.items()):
            moving.add_metric([role, state], n)
        yield moving

