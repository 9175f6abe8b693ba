"""Histories in Jepsen's manner: every client operation as an ``invoke`` event and then one completion, ``ok``
(acknowledged), ``fail`` (definitely not applied) or ``info`` (unknown: it may or may not have been applied), with
its client, its number, the rows it touched and monotonic times (one clock for every process of the machine).

A client process writes its events as JSON lines as they happen (``Recorder``), so a history survives the client's
own death; ``load`` reads them back and pairs each invocation with its completion (none: the client died with the
operation open, which counts as ``info``).
"""

from __future__ import annotations

import json
import pathlib
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

KINDS = ("ok", "fail", "info")


@dataclass
class Op:
    """One operation: its invocation and how it ended."""

    client: str
    k: int  # the client's operation number (from 0)
    ids: list[int]  # rows it adds 1 to (the first: its own, no other operation touches it)
    invoked: float  # time.monotonic() at invocation
    outcome: str = "info"  # ok, fail or info
    completed: Optional[float] = None
    error: str = ""
    shards: list[int] = field(default_factory=list)  # the shards its rows lived on, by the client's slot map as it
    # was invoked and as it completed (a live reshard moves rows between them)

    @property
    def own_row(self) -> int:
        return self.ids[0]


class Recorder:
    """A client's history file, written event by event (line-buffered, flushed: a crash loses at most the event
    being written)."""

    def __init__(self, path: pathlib.Path, client: str) -> None:
        self.client = client
        self._f = open(path, "a", buffering=1)

    def _write(self, event: dict) -> None:
        self._f.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._f.flush()

    def invoke(self, k: int, ids: list[int], shards: list[int]) -> None:
        self._write({"c": self.client, "type": "invoke", "k": k, "ids": ids, "shards": shards,
                     "t": time.monotonic()})

    def complete(self, k: int, outcome: str, error: str = "", shards: Optional[list[int]] = None) -> None:
        assert outcome in KINDS
        event: dict = {"c": self.client, "type": outcome, "k": k, "t": time.monotonic()}
        if error:
            event["error"] = error[:300]
        if shards:
            event["shards"] = shards
        self._write(event)

    def close(self) -> None:
        self._f.close()


def load(paths: Iterable[pathlib.Path]) -> list[Op]:
    """Every operation of the history files, in invocation order."""
    ops: dict[tuple[str, int], Op] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line cut by the writer's death
            key = (e["c"], e["k"])
            if e["type"] == "invoke":
                ops[key] = Op(e["c"], e["k"], list(e["ids"]), e["t"], shards=list(e.get("shards", [])))
            elif key in ops:
                op = ops[key]
                op.outcome, op.completed, op.error = e["type"], e["t"], e.get("error", "")
                op.shards = sorted(set(op.shards) | set(e.get("shards", [])))
    return sorted(ops.values(), key=lambda o: o.invoked)


def summary(ops: list[Op]) -> dict[str, int]:
    return {"operations": len(ops), "acknowledged": sum(o.outcome == "ok" for o in ops),
            "failed": sum(o.outcome == "fail" for o in ops), "unknown": sum(o.outcome == "info" for o in ops)}
