"""What a shard reports as it works (calls, rows, staleness, log flushes, checkpoints, synchronous steps).

The shard's parts report to the object they are given at construction. ``NullMetrics`` (``NO_METRICS``)
does nothing, so a shard nobody scrapes pays one no-op call per event; ``shardps.server.rpc.metrics.Metrics``
is the Prometheus implementation ``shardps serve --metrics-port`` serves.
"""

from __future__ import annotations


class NullMetrics:
    """What a shard reports, doing nothing: the shard without ``--metrics-port``."""

    enabled = False

    def call(self, method: str, seconds: float, request_bytes: int, response_bytes: int) -> None:
        pass

    def error(self, method: str, code: str) -> None:
        pass

    def pulled(self, table: str, rows: int, row_bytes: int) -> None:
        pass

    def pushed(self, table: str, rows: int, row_bytes: int, staleness: int) -> None:
        pass

    def wal_flush(self, seconds: float, records: int) -> None:
        pass

    def checkpoint(self, seconds: float, pause: float) -> None:
        pass

    def sync_step(self, waited: float, missing: int) -> None:
        pass


NO_METRICS = NullMetrics()
