"""Which connections use the data path, and over which transport: what ``shardps stats`` and the metrics show.

A connection is named as gRPC names peers (``ipv4:host:port``; a data-plane connection adds ``#`` and its
ZeroMQ routing id). Each data-path call (a unary call, a frame of a ``Stream``, a data-plane request) counts
for its connection: its transport (``zmq`` over TCP, ``zmq-ipc`` over a Unix socket, ``zmq-shm`` with a
shared-memory region too, ``grpc-stream`` or ``grpc-unary``), the caller it is charged to (its token, or the connection without tokens), calls and bytes,
and when it was last seen. At most ``MAX_PEERS`` are kept, the least recently seen forgotten first, so a client
opening connection after connection costs a bounded amount of memory.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

MAX_PEERS = 1024
RECENT_S = 60.0  # a connection seen within this long counts as a client of the shard now
TRANSPORTS = ("zmq", "zmq-ipc", "zmq-shm", "grpc-stream", "grpc-unary")


@dataclass
class Peer:
    peer: str
    transport: str
    caller: str
    calls: int = 0
    bytes: int = 0
    last_seen: float = 0.0


class Peers:
    """The data path's connections, most recently seen last (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}

    def seen(self, peer: str, transport: str, caller: str, nbytes: int) -> None:
        """One call of ``peer`` over ``transport`` (``nbytes``: its request and answer)."""
        now = time.monotonic()
        with self._lock:
            p = self._peers.pop(peer, None)
            if p is None:
                p = Peer(peer, transport, caller)
                if len(self._peers) >= MAX_PEERS:
                    self._peers.pop(next(iter(self._peers)))
            p.calls += 1
            p.bytes += nbytes
            p.last_seen = now
            p.transport, p.caller = transport, caller
            self._peers[peer] = p

    def recent(self, within_s: float = RECENT_S, limit: int = 256) -> list[tuple[Peer, float]]:
        """Connections seen within ``within_s`` seconds, most recent first, with seconds since each was seen."""
        now = time.monotonic()
        with self._lock:
            out = []
            for p in reversed(self._peers.values()):
                idle = now - p.last_seen
                if idle > within_s or len(out) >= limit:
                    break
                out.append((Peer(p.peer, p.transport, p.caller, p.calls, p.bytes, p.last_seen), idle))
        return out

    def by_transport(self, within_s: float = RECENT_S) -> dict[str, int]:
        """How many connections seen within ``within_s`` seconds use each transport."""
        counts = dict.fromkeys(TRANSPORTS, 0)
        for p, _ in self.recent(within_s, limit=MAX_PEERS):
            counts[p.transport] = counts.get(p.transport, 0) + 1
        return counts
