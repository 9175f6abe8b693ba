"""The data plane: pulls and pushes over ZeroMQ (libzmq, through pyzmq), beside gRPC.

gRPC's Python server moves every message through its own threads (a polling thread, a handler thread, copies
under the interpreter lock); on this workload that was 70-75% of a shard's CPU. Here each of ``threads``
ROUTER sockets (a port each) is served by one thread of its own, which receives a request, serves it through
the same call chain as a frame of the gRPC ``Stream`` call (role, fair turn, status, metrics; the handlers of
``DataPath``) and sends the answer: libzmq does the I/O in C, and no message changes threads in Python.

A call that waits (a synchronous step's last part waits for the other workers', an fsync under
``--fsync always``, a throttled or refused caller's pause) must not hold up the other connections of its
socket: the other workers' parts may be behind it. Before it waits (``fair.waiting``) its thread hands the
socket to a new thread (leader/followers: one thread uses a socket at a time) and finishes the call alone;
its answer goes back through the socket's leader, which meanwhile holds the connection's later requests and
serves them after it, in order. Calls that do not wait never change threads.

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
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import grpc
import zmq

from shardps.core.errors import ResourceExhausted, Unauthenticated
from shardps.core.tokens import bearer
from shardps.core.wake import WakePipe
from shardps.server.rpc import fair
from shardps.server.rpc.auth import Grant, Tokens
from shardps.server.rpc.chain import CallChain, stream_error

log = logging.getLogger(__name__)

HELLO = b"hello"
POLL_MS = 50  # how soon a stopping shard's data-plane threads notice
ANSWER_DRAIN_S = 0.25  # how long a stopping shard keeps its sockets open after the last answers it sent
CLOSE_LINGER_MS = 1000  # how long a stopping shard's sockets keep sending the answers already made
MAX_CONNECTIONS = 4096  # connections whose credentials a socket remembers (the oldest are forgotten first)
MAX_WAITING = 256  # calls waiting off their socket's thread at once (beyond: they wait on it)
MAX_QUEUED = 1024  # requests of one connection held behind its waiting call (beyond: RESOURCE_EXHAUSTED)
RECEIVE_BATCH = 64  # requests served per turn of the poll loop


class _SocketState:
    """A ROUTER socket and what its leader thread keeps: connections' credentials, connections with a call
    waiting off the socket's thread (and their requests held behind it), and finished calls to answer."""

    def __init__(self, sock: zmq.Socket, port: int) -> None:
        self.sock, self.port = sock, port
        self.leader: Optional[threading.Thread] = None  # the thread serving the socket now
        self.connections: dict[bytes, _Connection] = {}
        self.busy: dict[bytes, deque] = {}
        self.done: deque = deque()  # (connection, answer or None, later calls held) of calls that waited, by their thread
        self.wake = WakePipe()  # a thread that finished a waiting call wakes the leader through it


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
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()  # every thread serving or finishing a call
        self.waiting = 0  # calls waiting off their socket's thread now
        self.handoffs = 0  # calls that handed their socket to another thread, since start
        self.failure = ""  # why a socket stopped being served (empty: every one is)
        self._states = [_SocketState(sock, port) for sock, port in zip(self._sockets, self.ports)]

    def healthy(self) -> str:
        """Empty while every socket is served; else why one is not (the shard's health turns NOT_SERVING)."""
        if self.failure:
            return self.failure
        for st in self._states:
            if st.leader is None or not st.leader.is_alive():
                # A handover starts the next leader before the old one stops: read again before concluding.
                time.sleep(0.05)
                if st.leader is None or not st.leader.is_alive():
                    return f"data-plane port {st.port}: no thread serves it"
        return ""

    def start(self) -> DataPlane:
        for st in self._states:
            self._spawn(st)
        return self

    def stop(self) -> None:
        """Stop serving (requests not answered are resent by their clients to the next shard process)."""
        self._stop.set()
        deadline = time.monotonic() + 5.0
        while True:
            with self._lock:
                alive = [t for t in self._threads if t.is_alive()]
            if not alive or time.monotonic() > deadline:
                break
            alive[0].join(max(0.0, deadline - time.monotonic()))
        for st in self._states:
            # Calls that finished off the socket's thread (they waited: a synchronous step, a checkpoint's hold)
            # after its last leader stopped left their answers here: sent, so a push applied is not left unanswered
            # (its client would send it again: to another shard, if this one left the cluster).
            sent = 0
            while st.done:
                _, reply, _ = st.done.popleft()
                if reply is not None:
                    try:
                        st.sock.send_multipart(reply, copy=False, flags=zmq.NOBLOCK)
                        sent += 1
                    except zmq.ZMQError as e:  # that connection is gone: its client resends the call
                        log.info("data plane: an answer made while stopping was not sent: %s", e)
            if sent:
                log.info("data plane: %d answer(s) of calls that finished while it stopped sent", sent)
        if any(st.connections for st in self._states):
            # libzmq hands answers to the kernel, which must deliver them before the sockets close: a socket
            # closed with a client's bytes unread (a heartbeat, a request come too late) resets its connection,
            # and what the kernel had not sent yet is dropped. Meanwhile libzmq's I/O threads read what comes.
            time.sleep(ANSWER_DRAIN_S)
        for st in self._states:
            st.sock.close(CLOSE_LINGER_MS)  # the answers already made still go out (each client settles them)
            st.wake.close()
        self._ctx.term()

    # ---- serving a socket: one leader thread at a time ----------------------------------------

    def _spawn(self, st: _SocketState) -> None:
        t = threading.Thread(target=self._lead, args=(st,), name=f"data-plane-{st.port}", daemon=True)
        with self._lock:
            self._threads = {x for x in self._threads if x.is_alive()}
            self._threads.add(t)
        t.start()

    def _lead(self, st: _SocketState) -> None:
        """Serve ``st``'s socket until the shard stops or this thread hands the socket over (a call it serves
        is about to wait: the call finishes here, its answer goes back through the socket's next leader)."""
        st.leader = threading.current_thread()
        try:
            self._lead_until_handed_over(st)
        except Exception as e:  # noqa: BLE001 - the socket has no server now: health says so (NOT_SERVING)
            if not self._stop.is_set():
                log.exception("data plane: the thread of port %d failed", st.port)
                self.failure = f"data-plane port {st.port}: {e!r}"

    def _lead_until_handed_over(self, st: _SocketState) -> None:
        poller = zmq.Poller()
        poller.register(st.sock, zmq.POLLIN)
        poller.register(st.wake.fd, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(POLL_MS))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if st.wake.fd in ready:
                st.wake.drain()
            while st.done:  # calls finished off the socket's thread: answer, then their connection's next
                rid, reply, ordered = st.done.popleft()
                if reply is not None:
                    st.sock.send_multipart(reply, copy=False)
                if ordered and not self._resume(st, rid):
                    return
            if st.sock in ready and not self._receive(st):
                return

    def _receive(self, st: _SocketState) -> bool:
        """Serve the requests waiting on the socket; False once this thread handed the socket over."""
        for _ in range(RECEIVE_BATCH):
            try:
                parts = st.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            rid = parts[0].bytes
            queued = st.busy.get(rid)
            if queued is not None:  # its connection's earlier call is waiting: this one goes after it
                if len(queued) >= MAX_QUEUED:
                    self._refuse_queued(st, rid, parts)
                else:
                    queued.append(parts)
                continue
            if not self._serve(st, rid, parts):
                return False
        return True

    def _resume(self, st: _SocketState, rid: bytes) -> bool:
        """Serve what a connection sent while its call waited, in order; False once this thread handed over."""
        queued = st.busy[rid]
        while queued:
            if not self._serve(st, rid, queued.popleft()):
                return False  # a queued call waits in turn: the rest stay queued behind it
        del st.busy[rid]
        return True

    def _serve(self, st: _SocketState, rid: bytes, parts: list[Any]) -> bool:
        """One request, answered; False if it waited off the socket's thread (this thread no longer leads)."""
        handed = held = False

        def hand_off(ordered: bool) -> None:
            nonlocal handed, held
            with self._lock:
                if self.waiting >= MAX_WAITING or self._stop.is_set():
                    return  # too many waiting already: this one waits on the socket's thread
                self.waiting += 1
                self.handoffs += 1
            handed = True
            # Its connection's later calls are held behind it (a quorum's wait holds none back), and so are the
            # calls still queued behind an earlier waiting call of the connection (``_resume`` serves them in
            # turn: once this one is answered the next leader goes on with them, or they would wait for good).
            if ordered or rid in st.busy:
                held = True
                st.busy.setdefault(rid, deque())
            self._spawn(st)

        fair.on_wait(hand_off)
        reply = None
        try:
            reply = self._one(rid, parts, st.connections)
        except Exception:  # noqa: BLE001 - a bug must not stop the socket: logged, the request unanswered
            log.exception("data plane: request from %s failed", rid.hex())
        finally:
            fair.on_wait(None)
        if handed:
            with self._lock:
                self.waiting -= 1
            st.done.append((rid, reply, held))
            st.wake.wake()
            return False
        if reply is not None:
            st.sock.send_multipart(reply, copy=False)
        return True

    def _refuse_queued(self, st: _SocketState, rid: bytes, parts: list[Any]) -> None:
        if len(parts) < 3 or not parts[1].bytes:
            return  # not a request (or a hello): nothing to answer
        error = ResourceExhausted(f"data plane: over {MAX_QUEUED} requests of this connection wait behind "
                                  "its waiting call")
        code, message, kind = self.chain.status(error, "Stream")
        st.sock.send_multipart([rid, parts[1].bytes, stream_error(code, message, kind)], copy=False)

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
        reply = self.chain.frame(self.frames, parts[2].buffer, role, conn.key, conn.weight, conn.peer, "zmq")
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
