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
- ``[b"", b"hello", token]``: the connection's credentials, first of all when the shard has tokens (the
  token's role then bounds what each request may call). Answered ``[b"", b"ok"]`` or
  ``[b"", b"error", StreamError]``. Until a connection's hello is accepted, its requests are refused
  (UNAUTHENTICATED) before any is decoded.

With TLS every connection is sealed (``shardps.core.seal``: AES-256-GCM under a key of its own). Its client
asks ``ShardInfo`` (over gRPC with TLS: the shard's certificate authenticates it, and the call is encrypted)
for a session, an id and a key the shard keeps for a minute, for one connection. The hello is then
``[b"", b"hello", session id, counter, sealed token]`` and takes the session (its answer sealed too);
requests are ``[request id, counter, sealed StreamRequest]`` and answers ``[request id, counter, sealed
StreamResponse]``, each answer sealed with the session its request came on. A message that does not open
(another key, a byte changed, a counter not the next) is refused before anything in it is decoded, and its
connection is forgotten (``[b"", b"error", StreamError]``, unsealed). Only the shard that holds the
certificate's key learns a session's key, so an answer that opens comes from it.
A request above the size limit (``--max-message-mb``) closes its connection (libzmq's ``MAXMSGSIZE``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc
import zmq

from shardps.core import protocol, zmsg
from shardps.core.errors import ResourceExhausted, SessionUnknown, Unauthenticated
from shardps.core.seal import HELLO_AAD, SESSION_ID_BYTES, TO_CLIENT, TO_SHARD, Seal, SealError, new_key
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
SESSION_TTL_S = 60.0  # how long a session handed out by ShardInfo waits for its connection's hello
MAX_SESSIONS = 4096  # sessions waiting for their hello at once (beyond: the oldest are forgotten)


_Answer = tuple[list, Optional[Seal]]  # an answer's parts, and the session that seals it (None: sent as it is)


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
    seal: Optional[Seal] = None  # with TLS: the connection's session
    transport: str = field(init=False)  # "zmq-ipc" over a Unix socket, else "zmq" (metrics, ``shardps stats``)

    def __post_init__(self) -> None:
        self.transport = "zmq-ipc" if self.peer.startswith("unix:") else "zmq"


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


class DataPlane:
    """ZeroMQ sockets serving a shard's pulls and pushes (see the module docstring).

    Args:
        chain: the shard's call chain (what a gRPC stream frame goes through).
        frames: the data path's frame handlers (``DataPath.frames``).
        host: the address to bind (the gRPC server's host).
        ports: the ports to bind, one socket and thread each (0: a free port).
        max_message_bytes: the largest request accepted.
        tokens: bearer tokens (None: every connection allowed).
        encrypted: every connection sealed under a session ``ShardInfo`` hands out (the shard serves TLS).
        ipc: each socket also bound as an abstract Unix socket (Linux), for clients in the shard's network
            namespace on its machine (``protocol.local_scope``): the same requests, answers, tokens and seals,
            with less of the kernel's TCP work per message.
    """

    def __init__(self, chain: CallChain, frames: dict, host: str, ports: list[int], max_message_bytes: int,
                 tokens: Optional[Tokens], encrypted: bool, ipc: bool = True) -> None:
        self.chain = chain
        self.frames = frames
        self.tokens = tokens
        self.sessions = Sessions() if encrypted else None
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self.ports: list[int] = []
        host = "*" if host in ("0.0.0.0", "::") else host
        for port in ports:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + 64 * 1024)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            if port:
                sock.bind(f"tcp://{host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{host}")
            self._sockets.append(sock)
            self.ports.append(port)
        self.ipc: list[str] = _bind_unix(self._sockets) if ipc else []  # the Unix sockets' names, one per port
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
        if alive:  # a thread still serves a call (it could not hand its socket over): the sockets are its
            log.warning("data plane: %d thread(s) still serving after 5 s; their answers are not sent", len(alive))
        for st in self._states if not alive else ():
            # Calls that finished off the socket's thread (they waited: a synchronous step, a checkpoint's hold)
            # after its last leader stopped left their answers here: sent, so a push applied is not left unanswered
            # (its client would send it again: to another shard, if this one left the cluster).
            sent = 0
            while st.done:
                _, reply, _ = st.done.popleft()
                if reply is not None:
                    try:
                        _send(st, reply, zmq.NOBLOCK)
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
        zmsg.answer_in_place()  # large answers made on this thread go out of libzmq's memory without a copy
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
                    _send(st, reply)
                if ordered and not self._resume(st, rid):
                    return
            if st.sock in ready and not self._receive(st):
                return

    def _receive(self, st: _SocketState) -> bool:
        """Serve the requests waiting on the socket; False once this thread handed the socket over."""
        for _ in range(RECEIVE_BATCH):
            if not st.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # (asked first: pyzmq's Again costs a raise)
                return True
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
        reply: Optional[_Answer] = None
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
            _send(st, reply)
        return True

    def _refuse_queued(self, st: _SocketState, rid: bytes, parts: list[Any]) -> None:
        if len(parts) < 3 or not parts[1].bytes:
            return  # not a request (or a hello): nothing to answer
        error = ResourceExhausted(f"data plane: over {MAX_QUEUED} requests of this connection wait behind "
                                  "its waiting call")
        code, message, kind = self.chain.status(error, "Stream")
        conn = st.connections.get(rid)
        if conn is not None and conn.seal is not None:  # its counter would be skipped: the connection must go
            _send(st, _end_session(st.connections, rid, code, message, kind))
            return
        _send(st, ([rid, parts[1].bytes, stream_error(code, message, kind)], None))

    def _one(self, rid: bytes, parts: list[Any], connections: dict[bytes, _Connection]) -> Optional[_Answer]:
        if len(parts) < 3:
            self.chain.slow_refusal(_peer(rid, parts[-1]), grpc.StatusCode.INVALID_ARGUMENT, sum(len(p) for p in parts))
            return None  # not a request: no request id to answer
        request_id = parts[1].bytes
        if not request_id:
            fields, seal = self._hello(rid, parts[2:], _peer(rid, parts[-1]), connections)
            return [rid, b"", *fields], seal
        conn = connections.get(rid)
        if conn is None:  # (a known connection's peer was named at its first request: not looked up per request)
            peer = _peer(rid, parts[-1])
            if self.tokens is not None or self.sessions is not None:
                error = Unauthenticated("data plane: this connection has not presented its credentials (hello)")
                code, message, kind = self.chain.status(error, "Stream")
                self.chain.slow_refusal(peer, code, len(parts[2]))
                return [rid, request_id, stream_error(code, message, kind)], None
            conn = self._remember(rid, _Connection(None, peer, 1.0, peer), connections)
        elif next(reversed(connections)) != rid:  # the most recently used last: the first to go are the idle ones
            connections[rid] = connections.pop(rid)
        frame = parts[2].buffer
        if conn.seal is not None:
            try:
                if len(parts) != 4:
                    raise SealError(f"a sealed request has 3 parts (request id, counter, sealed), got {len(parts) - 1}")
                frame = conn.seal.open(parts[2].buffer, parts[3].buffer, request_id)
            except SealError as e:  # nothing of it decoded; the connection must make a new session
                code, message, kind = self.chain.status(Unauthenticated(f"data plane: {e}"), "Stream")
                self.chain.slow_refusal(conn.peer, code, sum(len(p) for p in parts[2:]))
                return _end_session(connections, rid, code, message, kind)
        role = conn.grant.role if conn.grant is not None else None
        reply = self.chain.frame(self.frames, frame, role, conn.key, conn.weight, conn.peer, conn.transport)
        return [rid, request_id, reply], conn.seal  # (sealed with it even if the connection is forgotten meanwhile)

    def _hello(self, rid: bytes, fields: list[Any], peer: str,
               connections: dict[bytes, _Connection]) -> tuple[list, Optional[Seal]]:
        """The hello's answer, and the session to seal it with (None: no session opened)."""
        seal = None
        try:
            if not fields or fields[0].bytes != HELLO:
                raise Unauthenticated("data plane: a control message must be a hello")
            if self.sessions is not None:
                if len(fields) != 4:
                    raise Unauthenticated("data plane: with TLS a hello is [b'hello', session id, counter, sealed "
                                          "token] (ask ShardInfo over TLS for a session)")
                seal, raw = self.sessions.open_hello(fields[1].bytes, fields[2].buffer, fields[3].buffer)
            elif len(fields) != 2:
                raise Unauthenticated("data plane: a hello is [b'hello', token]")
            else:
                raw = fields[1].bytes
            token = raw.decode("utf-8", "replace")
            grant = None
            if self.tokens is not None:
                grant = self.tokens.check(bearer(token) if token else (), "Pull")
            key, weight = (grant.key, grant.limits.weight) if grant is not None else (peer, 1.0)
            self._remember(rid, _Connection(grant, key, weight, peer, seal), connections)
            return [b"ok"], seal
        except Exception as e:  # noqa: BLE001 - UNAUTHENTICATED / PERMISSION_DENIED, answered
            code, message, kind = self.chain.status(e, "Stream")
            self.chain.slow_refusal(peer, code)
            return [b"error", stream_error(code, message, kind)], seal

    @staticmethod
    def _remember(rid: bytes, conn: _Connection, connections: dict[bytes, _Connection]) -> _Connection:
        connections.pop(rid, None)
        connections[rid] = conn
        while len(connections) > MAX_CONNECTIONS:
            connections.pop(next(iter(connections)))
        return conn


def _end_session(connections: dict[bytes, _Connection], rid: bytes, code: grpc.StatusCode, message: str,
                 kind: str) -> _Answer:
    """Forget a sealed connection whose counters can no longer agree (a request that did not open, one refused
    unread): its answer is an unsealed error in the hello's place, and the client makes a new session."""
    connections.pop(rid, None)
    return [rid, b"", b"error", stream_error(code, message, kind)], None


def _send(st: _SocketState, answer: _Answer, flags: int = 0) -> None:
    """Send an answer, ``[rid, request id, StreamResponse]`` or a hello's ``[rid, b"", b"ok" / b"error", ...]``,
    sealed now with the session its request came on (in the order answers leave: the counters rise as the
    client receives them). Only refusals of what came with no session (no hello, a hello that did not open, a
    request that did not open) leave unsealed."""
    reply, seal = answer
    if seal is not None:
        rid, request_id, body = reply[0], reply[1], reply[-1]
        if request_id:
            reply = [rid, request_id, *seal.seal(body, request_id)]
        else:  # the hello's answer: b"ok", or b"error" and its StreamError
            what = reply[2]
            reply = [rid, b"", what, *seal.seal(body if what != b"ok" else b"", HELLO_AAD + what)]
    # A large answer was built in a libzmq message (``zmsg``: sent from it, no copy); the rest is copied into libzmq's
    # messages, not sent zero-copy: pyzmq frees a zero-copy frame through its garbage-collector thread, a Python
    # thread woken per message that takes the GIL from the thread serving calls (docs/performance.md).
    zmsg.send_multipart(st.sock, reply, flags)


def _bind_unix(sockets: list[zmq.Socket]) -> list[str]:
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


def _peer(rid: bytes, frame: Any) -> str:
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
