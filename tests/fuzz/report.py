"""What a fuzz run found: its failures, and the table of status codes seen per method."""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Optional, Union

import grpc


@dataclasses.dataclass
class Failure:
    method: str
    kind: str  # "status", "state", "crash", "memory", "unresponsive", "stream", "restart", "harness"
    detail: str
    payload: Union[bytes, list, None] = None
    cause: str = ""

    def key(self) -> tuple:
        return (self.method, self.kind, re.sub(r"\d+", "N", self.cause or self.detail.split("\n")[0])[:160])

    def size(self) -> int:
        if isinstance(self.payload, list):
            return sum(len(p) for p in self.payload)
        return len(self.payload or b"")

    def payload_hex(self, limit: int = 4096) -> str:
        def h(b: bytes) -> str:
            return b.hex() if len(b) <= limit else f"{b[:limit].hex()}... ({len(b)} bytes)"

        if isinstance(self.payload, list):
            return " | ".join(h(p) for p in self.payload)
        return h(self.payload or b"")


@dataclasses.dataclass
class Report:
    counts: collections.Counter
    failures: list[Failure]
    rss_peak: int
    restarts: int
    elapsed: float
    examples: int
    seed: int
    server_code: str = ""
    restart_ok: Optional[bool] = None
    restart_checks: int = 0

    def format(self, max_groups: int = 60) -> str:
        lines = [
            f"server code: {self.server_code}" if self.server_code else "",
            f"examples per method: {self.examples}, seed {self.seed}, {self.elapsed:.1f}s, "
            f"shard restarts after failures: {self.restarts}",
        ]
        lines += self._table()
        lines.append(f"RSS peak: {self.rss_peak / (1 << 20):.1f} MiB")
        if self.restart_ok is not None:
            lines.append(
                f"kill -9 + restart on the data dir ({self.restart_checks} checks: after each push method and "
                f"at the end): {'ok' if self.restart_ok else 'FAILED'}"
            )
        lines += self._failure_lines(max_groups)
        return "\n".join(ln for ln in lines if ln != "")

    def _table(self) -> list[str]:
        """Method x status code: how many calls got each code (methods in the order they ran)."""
        methods = list(dict.fromkeys(m for m, _ in self.counts))
        order = [c.name for c in grpc.StatusCode] + ["SKIPPED"]
        codes = [c for c in order if any(k[1] == c for k in self.counts)]
        width = max([len(m) for m in methods] + [12])
        lines = ["method".ljust(width) + "".join(c.rjust(max(len(c), 6) + 2) for c in codes)]
        for m in methods:
            lines.append(
                m.ljust(width) + "".join(str(self.counts.get((m, c), 0) or "").rjust(max(len(c), 6) + 2) for c in codes)
            )
        return lines

    def _failure_lines(self, max_groups: int) -> list[str]:
        """The failures grouped by method, kind and cause; each group with its smallest input."""
        groups: dict[tuple, list[Failure]] = {}
        for f in self.failures:
            groups.setdefault(f.key(), []).append(f)
        lines = [f"failures: {len(self.failures)} ({len(groups)} distinct)"]
        for key, fs in list(groups.items())[:max_groups]:
            smallest = min(fs, key=Failure.size)
            lines.append(f"- [{key[0]}] {key[1]} x{len(fs)}: {smallest.detail.splitlines()[0][:300]}")
            if smallest.cause:
                lines.append(f"    cause: {smallest.cause}")
            if smallest.payload is not None:
                lines.append(f"    smallest input ({smallest.size()} bytes): {smallest.payload_hex()}")
            if fs[0] is not smallest and fs[0].payload is not None:  # a shard poisoned by an earlier call
                lines.append(f"    first input ({fs[0].size()} bytes): {fs[0].payload_hex()}")
        return lines
