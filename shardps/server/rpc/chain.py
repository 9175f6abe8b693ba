"""The one chain every call passes through, unary calls and stream frames alike, each step small:

authenticate (the caller's token, before the request is decoded) -> admit (per-caller limits on calls
open) -> take a fair turn (data-path calls, ``shardps.server.rpc.fair``) -> the handler -> on error, a
status code from the status table (``shardps.core.status``: here and only here) and, for a caller
failing many calls, a slowed refusal -> metrics.

Why not ``grpc.ServerInterceptor``s: most of the data path travels as frames of one ``Stream`` call,
which interceptors see once, not per frame; one explicit chain serves both the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import grpc

from shardps.core import protocol, status, wire
from shardps.core.errors import InvalidArgument, PermissionDenied, clip
from shardps.core.wire import parse
from shardps.server.rpc import fair
from shardps.server.rpc.auth import ALLOWED, Grant, Tokens
from shardps.server.rpc.fair import Callers, FairScheduler
from shardps.server.rpc.peers import Peers
from shardps.server.shard.facade import Shard
from shardps.v1 import shardps_pb2 as pb

log = logging.getLogger(__name__)

# The data path: these calls take turns in fair order; the others are cheap or wait.
GATED = frozenset({"Pull", "Push", "PullDense", "PushDense", "PullBatch", "PushBatch"})
# Refusals that a well-behaved client rarely gets: a caller getting many has them slowed down.
PENALIZED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                       grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})
MAX_ERROR_CHARS = 1024  # status details travel in metadata (8 KiB by default): never echo a request into it

Handler = Callable[[Any, grpc.ServicerContext], Any]


class CallChain:
    """Authentication, admission, fair turns, status mapping and metrics for one shard's calls."""

    def __init__(self, shard: Shard, tokens: Optional[Tokens], scheduler: FairScheduler, callers: Callers) -> None:
        self.shard = shard
        self.tokens = tokens  # None: every call allowed (no tokens file)
        self.scheduler = scheduler
        self.callers = callers
        self._local = threading.local()  # the grant of the call this handler thread serves
        self.peers = Peers()  # the data path's connections and their transports (shardps stats)

    def grant(self) -> Optional[Grant]:
        """The token grant of the call this thread serves (None without tokens)."""
        return getattr(self._local, "grant", None) if self.tokens is not None else None

    def unary(self, name: str, handler: Handler, request: bytes, context: grpc.ServicerContext) -> Any:
        """One unary call of method ``name`` through the chain; ``handler`` gets the parsed request (or the raw
        bytes for methods that read the wire themselves)."""
        spec = protocol.METHODS[name]
        started = time.perf_counter()
        peer = context.peer()
        try:
            grant = None
            if self.tokens is not None:  # before the request is decoded
                grant = self._local.grant = self.tokens.check(context.invocation_metadata(), name)
                self.callers.enter("calls", [(grant.key, grant.limits.max_calls)], name)
            key, weight = (grant.key, grant.limits.weight) if grant else (peer, 1.0)
            gated = name in GATED
            try:
                if gated:
                    self.scheduler.acquire(key, weight)
                result = handler(request if spec.wire_request else parse(spec.request, request), context)
            finally:
                fair.release()
                if grant is not None:
                    self.callers.exit("calls", [grant.key])
            if gated:
                nbytes = len(request) + _size(result)
                self.scheduler.charge(key, weight, 0.0, nbytes)
                self.peers.seen(peer, "grpc-unary", key, nbytes)
        except Exception as e:  # noqa: BLE001 - every error becomes a status (see status)
            code, message, kind = self.status(e, name)
            self.slow_refusal(peer, code, len(request))
            if kind:
                redirect = getattr(e, "redirect", "")
                context.set_trailing_metadata(((status.KIND_METADATA, kind),) +
                                              (((status.REDIRECT_METADATA, redirect),) if redirect else ()))
            context.abort(code, message)
        self._measure(name, started, len(request), _size(result))
        return result

    def frame(self, frames: dict[str, Callable[[memoryview, int], wire.Buffer]], request: wire.Buffer,
              role: Optional[str], key: str, weight: float, peer: str, transport: str = "grpc-stream") -> wire.Buffer:
        """One stream frame of a caller (``key``, its fair-share weight; ``peer``, its connection), answered; a
        refused frame is answered with a StreamError and the stream goes on. ``transport``: what carried it
        ("grpc-stream" or "zmq", the data plane)."""
        started, name = time.perf_counter(), "Stream"
        try:
            field, view = wire.unframe(request)
            method = protocol.by_stream_field(field)
            if method is None:
                raise InvalidArgument(f"StreamRequest field {field} is not a call this shard knows")
            name = method.name
            if role is not None and name not in ALLOWED[role]:
                raise PermissionDenied(f"role {role} may not call {name}")
            self.scheduler.acquire(key, weight)
            try:
                reply = frames[name](view, field)  # framed as the StreamResponse field of that number
            finally:
                fair.release()
            nbytes = len(request) + len(reply)
            self.scheduler.charge(key, weight, 0.0, nbytes)
            self.peers.seen(peer, transport, key, nbytes)
            self._measure(name, started, len(request), len(reply))
            return reply
        except Exception as e:  # noqa: BLE001 - answered with a StreamError; the stream goes on
            code, message, kind = self.status(e, name)
            redirect = getattr(e, "redirect", "")
        self.slow_refusal(peer, code, len(request))
        return stream_error(code, message, kind, redirect)

    def status(self, e: Exception, method: str) -> tuple[grpc.StatusCode, str, str]:
        """The status code, message and kind (shardps.core.status) of an error in ``method``
        (counted; an error of no kind is a bug: INTERNAL, logged)."""
        st = status.of_error(e)
        if st is not None:
            self.shard.count_error()
            self.shard.metrics.error(method, st.code)
            return grpc.StatusCode[st.code], clip(f"shard {self.shard.index}: {e}", MAX_ERROR_CHARS), st.kind
        log.error("internal error in %s", method, exc_info=e)
        self.shard.metrics.error(method, "INTERNAL")
        return grpc.StatusCode.INTERNAL, f"shard {self.shard.index}: internal error in {method}", ""

    def slow_refusal(self, connection: str, code: grpc.StatusCode, nbytes: int = 0) -> None:
        """A refusal a well-behaved client rarely gets waits a little when its connection gets many
        (shardps.server.rpc.fair): a flood of malformed or unauthenticated calls then costs the shard little."""
        if code in PENALIZED:
            delay = self.callers.failed(connection, nbytes)
            if delay:
                fair.waiting()
                time.sleep(delay)

    def _measure(self, name: str, started: float, request_bytes: int, reply_bytes: int) -> None:
        metrics = self.shard.metrics
        if metrics.enabled:
            metrics.call(name, time.perf_counter() - started, request_bytes, reply_bytes)


def caller_limits(peer: str, grant: Optional[Grant], per_connection: int,
                  token_limit: str) -> list[tuple[str, Optional[int]]]:
    """The callers a stream or waiting call counts against: its connection, and its token if any."""
    limits: list[tuple[str, Optional[int]]] = [(peer, per_connection)]
    if grant is not None:
        limits.append((grant.key, getattr(grant.limits, token_limit)))
    return limits


def stream_error(code: grpc.StatusCode, message: str, kind: str, redirect: str = "") -> bytes:
    """A refused call's answer on a stream (or the data plane): a StreamResponse holding its StreamError."""
    return pb.StreamResponse(error=pb.StreamError(code=code.value[0], message=message, kind=kind,
                                                  redirect=redirect)).SerializeToString()


def _size(reply: Any) -> int:
    return len(reply) if isinstance(reply, (bytes, bytearray, memoryview)) else reply.ByteSize()
