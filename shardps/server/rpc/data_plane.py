"""The data plane: pulls and pushes over ZeroMQ (libzmq, through pyzmq), beside gRPC.

gRPC's Python server moves every message through its own threads (a polling thread, a handler thread, copies
under the interpreter lock); on this workload that was 70-75% of a shard's CPU. Here each of ``threads``
ROUTER sockets (a port each) is served by one thread of its own, which receives a request, serves it through
the same call chain as a frame of the gRPC ``Stream`` call (role, fair turn, status, metrics; the handlers of
``DataPath``) and sends the answer: libzmq does the I/O in C, and no message changes threads in Python.

Protocol (multipart messages; a client connects one DEALER to one of the ports, chosen by its client id):

- ``[request id, frame]``: ``frame`` is a ``StreamRequest`` as the gRPC stream carries it; the answer is
  ``[request id, StreamResponse]``. A connection's requests are served one after another, in the order they
  came (a pull sees the connection's earlier pushes).
- ``[b"", b"hello", token, ticket]``: the connection's credentials, first of all when the shard has tokens
  (the token's role then bounds what each request may call) or TLS (the ticket ``ShardInfo`` hands out over
  the authenticated gRPC call). Answered ``[b"", b"ok"]`` or ``[b"", b"error", StreamError]``. Until a
  connection's hello is accepted, its requests are refused (UNAUTHENTICATED) before any is decoded.

With TLS the sockets use CURVE: the shard's key pair is made at start and its public key is handed out by
``ShardInfo`` over TLS, so a client that trusts the shard's certificate trusts the key; traffic is encrypted.
A request above the size limit (``--max-message-mb``) closes its connection (libzmq's ``MAXMSGSIZE``).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

import grpc
import zmq

from shardps.core.errors import Unauthenticated
from shardps.core.tokens import bearer
from shardps.server.rpc.auth import Grant, Tokens
from shardps.server.rpc.chain import CallChain, stream_error

log = logging.getLogger(__name__)

HELLO = b"hello"
POLL_MS = 50  # how soon a stopping shard's data-plane threads notice
MAX_CONNECTIONS = 4096  # connections whose credentials a socket remembers (the oldest are forgotten first)


@dataclass
class _Connection:
    grant: Optional[Grant]
    key: str
    weight: float
    peer: str


class DataPlane:
    """ZeroMQ sockets serving a shard's pulls and pushes (see the module docstring).

    Args:
        chain: the shard's call chain (what a gRPC stream frame goes through).
        frames: the data path's frame handlers (``DataPath.frames``).
        host: the address to bind (the gRPC server's host).
        ports: the ports to bind, one socket and thread each (0: a free port).
        max_message_bytes: the largest request accepted.
        tokens: bearer tokens (None: every connection allowed).
        encrypted: CURVE encryption, and a ticket required in every connection's hello (the shard serves TLS).
    """

    def __init__(self, chain: CallChain, frames: dict, host: str, ports: list[int], max_message_bytes: int,
                 tokens: Optional[Tokens], encrypted: bool) -> None:
        self.chain = chain
        self.frames = frames
        self.tokens = tokens
        self.ticket = os.urandom(32) if encrypted else b""
        self._ctx = zmq.Context()
        self.public_key = ""
        secret = b""
        if encrypted:
            public, secret = zmq.curve_keypair()
            self.public_key = public.decode()
        self._sockets: list[zmq.Socket] = []
        self.ports: list[int] = []
        host = "*" if host in ("0.0.0.0", "::") else host
        for port in ports:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + 64 * 1024)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            if encrypted:
                sock.curve_server = True
                sock.curve_secretkey = secret
                sock.curve_publickey = public
            if port:
                sock.bind(f"tcp://{host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{host}")
            self._sockets.append(sock)
            self.ports.append(port)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, args=(sock,), name=f"data-plane-{port}", daemon=True)
                         for sock, port in zip(self._sockets, self.ports)]

    def start(self) -> DataPlane:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop serving (requests not answered are resent by their clients to the next shard process)."""
        self._stop.set()
        for t in self._threads:
            t.join(5.0)
        for sock in self._sockets:
            sock.close(0)
        self._ctx.term()

    # ---- one socket's thread ----------------------------------------------------------------

    def _serve(self, sock: zmq.Socket) -> None:
        connections: dict[bytes, _Connection] = {}
        while not self._stop.is_set():
            try:
                if not sock.poll(POLL_MS):
                    continue
                parts = sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            rid = parts[0].bytes
            try:
                reply = self._one(rid, parts, connections)
            except Exception:  # noqa: BLE001 - a bug must not stop the socket: logged, the request unanswered
                log.exception("data plane: request from %s failed", rid.hex())
                continue
            if reply is not None:
                sock.send_multipart(reply, copy=False)

    def _one(self, rid: bytes, parts: list[Any], connections: dict[bytes, _Connection]) -> Optional[list]:
        peer = f"{_peer(parts[-1])}#{rid.hex()}"  # a connection, as gRPC's peer names one (address and port)
        if len(parts) < 3:
            self.chain.slow_refusal(peer, grpc.StatusCode.INVALID_ARGUMENT, sum(len(p) for p in parts))
            return None  # not a request: no request id to answer
        request_id = parts[1].bytes
        if not request_id:
            return [rid, b"", *self._hello(rid, parts[2:], peer, connections)]
        conn = connections.get(rid)
        if conn is None:
            if self.tokens is not None or self.ticket:
                error = Unauthenticated("data plane: this connection has not presented its credentials (hello)")
                code, message, kind = self.chain.status(error, "Stream")
                self.chain.slow_refusal(peer, code, len(parts[2]))
                return [rid, request_id, stream_error(code, message, kind)]
            conn = self._remember(rid, _Connection(None, peer, 1.0, peer), connections)
        role = conn.grant.role if conn.grant is not None else None
        reply = self.chain.frame(self.frames, parts[2].buffer, role, conn.key, conn.weight, conn.peer)
        return [rid, request_id, reply]

    def _hello(self, rid: bytes, fields: list[Any], peer: str, connections: dict[bytes, _Connection]) -> list:
        try:
            if len(fields) != 3 or fields[0].bytes != HELLO:
                raise Unauthenticated("data plane: a control message must be [b'hello', token, ticket]")
            token, ticket = fields[1].bytes.decode("utf-8", "replace"), fields[2].bytes
            if self.ticket and not hmac.compare_digest(ticket, self.ticket):
                raise Unauthenticated("data plane: wrong or missing ticket (ask ShardInfo over TLS for it)")
            grant = None
            if self.tokens is not None:
                grant = self.tokens.check(bearer(token) if token else (), "Pull")
            key, weight = (grant.key, grant.limits.weight) if grant is not None else (peer, 1.0)
            self._remember(rid, _Connection(grant, key, weight, peer), connections)
            return [b"ok"]
        except Exception as e:  # noqa: BLE001 - UNAUTHENTICATED / PERMISSION_DENIED, answered
            code, message, kind = self.chain.status(e, "Stream")
            self.chain.slow_refusal(peer, code)
            return [b"error", stream_error(code, message, kind)]

    @staticmethod
    def _remember(rid: bytes, conn: _Connection, connections: dict[bytes, _Connection]) -> _Connection:
        connections.pop(rid, None)
        connections[rid] = conn
        while len(connections) > MAX_CONNECTIONS:
            connections.pop(next(iter(connections)))
        return conn


def _peer(frame: Any) -> str:
    """The remote address of a received frame's connection, as gRPC names peers."""
    try:
        return f"ipv4:{frame.get('Peer-Address')}"
    except (zmq.ZMQError, AttributeError):
        return "zmq"
