"""A data-plane connection as its socket's thread knows it (``shardps.server.rpc.data_plane``): its credentials
and fair-share key, its TLS session (handed out by ``ShardInfo``, ``Sessions``), its shared-memory region, and how
its peer is named; and the abstract Unix sockets clients on this machine reach the data plane at."""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from shardps.core import protocol, region
from shardps.core.errors import SessionUnknown, Unauthenticated
from shardps.core.seal import HELLO_AAD, SESSION_ID_BYTES, TO_CLIENT, TO_SHARD, Seal, SealError, new_key
from shardps.server.rpc.auth import Grant

log = logging.getLogger(__name__)

SESSION_TTL_S = 60.0  # how long a session handed out by ShardInfo waits for its connection's hello
MAX_SESSIONS = 4096  # sessions waiting for their hello at once (beyond: the oldest are forgotten)


@dataclass
class Connection:
    grant: Optional[Grant]
    key: str
    weight: float
    peer: str
    seal: Optional[Seal] = None  # with TLS: the connection's session
    region: Optional[region.ShardRegion] = None  # shared memory with its client (a Unix socket's, when asked)
    used: float = 0.0  # when it last sent a request (monotonic), while it has a region
    transport: str = field(init=False)  # "zmq-shm" with a region, "zmq-ipc" over a Unix socket, else "zmq"

    def __post_init__(self) -> None:
        self.transport = ("zmq-shm" if self.region is not None else "zmq-ipc" if self.peer.startswith("unix:")
                          else "zmq")


class Sessions:
    """Sessions handed out by ``ShardInfo`` (over TLS), each waiting for the one connection that presents it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[bytes, tuple[bytes, float]] = {}  # id -> (key, when handed out), oldest first

    def issue(self) -> tuple[bytes, bytes]:
        """A new session: (id, key)."""
        sid, key, now = os.urandom(SESSION_ID_BYTES), new_key(), time.monotonic()
        with self._lock:
            while self._waiting:  # the oldest go first: expired, or too many waiting
                oldest = next(iter(self._waiting))
                if len(self._waiting) < MAX_SESSIONS and now - self._waiting[oldest][1] < SESSION_TTL_S:
                    break
                del self._waiting[oldest]
            self._waiting[sid] = (key, now)
        return sid, key

    def open_hello(self, sid: bytes, counter: Any, sealed: Any) -> tuple[Seal, bytes]:
        """The connection's seal and the token its hello carries; the session is taken only if the hello opens
        (a forged hello with a session id seen on the wire takes nothing from its client)."""
        with self._lock:
            entry = self._waiting.get(sid)
        if entry is None or time.monotonic() - entry[1] > SESSION_TTL_S:
            raise SessionUnknown("data plane: unknown, expired or used session (ask ShardInfo over TLS for one)")
        seal = Seal(entry[0], sending=TO_CLIENT, receiving=TO_SHARD)
        try:
            token = seal.open(counter, sealed, HELLO_AAD + sid)
        except SealError as e:
            raise Unauthenticated(f"data plane: the hello does not open with its session's key: {e}") from None
        with self._lock:
            if self._waiting.pop(sid, None) is None:
                raise SessionUnknown("data plane: that session was taken by another connection")
        return seal, token



def regions_work() -> bool:
    """Whether this platform has what regions need (Linux's memfd with seals)."""
    return hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING") and os.path.isdir("/proc/self/fd")


def bind_unix(sockets: list[zmq.Socket]) -> list[str]:
    """Bind each socket also as an abstract Unix socket (Linux): their names, or none where that cannot be done.
    Abstract names leave no file behind a kill -9, and are unguessable so no other process can hold one first."""
    if not protocol.local_scope():
        return []
    names = [f"shardps-{os.getpid()}-{os.urandom(8).hex()}-{i}" for i in range(len(sockets))]
    try:
        for sock, name in zip(sockets, names):
            sock.bind(f"ipc://@{name}")
    except zmq.ZMQError as e:  # clients on this machine use TCP, as the others do
        log.warning("data plane: no Unix sockets (%s); clients on this machine use TCP", e)
        return []
    return names


def peer_name(rid: bytes, frame: Any) -> str:
    """Connection ``rid``, as gRPC names peers: the remote address of a frame it sent ("unix:..." over a Unix
    socket) and its routing id."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return f"zmq#{rid.hex()}"
    try:
        return f"ipv{ipaddress.ip_address(address).version}:{address}#{rid.hex()}"
    except ValueError:  # a Unix socket: libzmq names its peer by credentials
        return f"unix:{address}#{rid.hex()}"
