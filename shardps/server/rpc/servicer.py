"""gRPC servicer: every method a few lines over the shard, through the call chain (``chain``).

Requests arrive as bytes; the chain authenticates, admits, schedules, parses and maps errors to status
codes (and only it does); ``convert`` turns protobuf into plain values and back; ``data_path`` serves
pulls and pushes, as unary calls and as frames of a ``Stream``.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any, Callable, Iterator, Optional, TypeVar, cast

import grpc

from shardps.core import protocol, status
from shardps.core.errors import Unavailable
from shardps.core.specs import dense_spec_from_pb, table_spec_from_pb
from shardps.core.wire import parse
from shardps.server.rpc import convert, migrate, replication
from shardps.server.rpc.auth import Grant, Tokens
from shardps.server.rpc.chain import CallChain, caller_limits
from shardps.server.rpc.data_path import DataPath
from shardps.server.rpc.fair import Callers, FairConfig, FairScheduler
from shardps.server.shard.facade import Shard
from shardps.v1 import shardps_pb2 as pb
from shardps.v1 import shardps_pb2_grpc as pb_grpc

F = TypeVar("F", bound=Callable[..., Any])


def _rpc(method: F) -> F:
    """Run a servicer method through the call chain, on the raw request bytes."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: ShardServicer, request: bytes, context: grpc.ServicerContext) -> Any:
        return self.chain.unary(name, functools.partial(method, self), request, context)

    return wrapper  # type: ignore[return-value]


class ShardServicer(pb_grpc.ShardServicer):
    """The ``shardps.v1.Shard`` service over one ``Shard``."""

    def __init__(self, shard: Shard, max_streams: int = 64, tokens: Optional[Tokens] = None,
                 fairness: FairConfig = FairConfig()) -> None:
        self.shard = shard
        self.max_streams = max_streams
        self.tokens = tokens
        self.fairness = fairness
        self.scheduler = FairScheduler(fairness.slots)
        self.callers = Callers()
        self.chain = CallChain(shard, tokens, self.scheduler, self.callers)
        self.data = DataPath(shard)
        self._waiting = 0  # heartbeats waiting for other workers, all callers
        self._streams: set[grpc.ServicerContext] = set()
        self._streams_lock = threading.Lock()
        self._stopping = False
        self.data_plane: Any = None  # the shard's DataPlane, when it has one (ShardInfo tells clients)
        self.replica: Any = None  # this shard's ReplicaMember, in a replica group (shardps.server.replica)

    def _may_create(self) -> bool:
        """Whether this call may create a table or dense tensor (an admin's token, or no tokens at all)."""
        grant = self.chain.grant()
        return self.tokens is None or (grant is not None and grant.role == "admin")

    # ---- tables ----------------------------------------------------------------------

    @_rpc
    def CreateTable(self, request: pb.CreateTableRequest, context: grpc.ServicerContext) -> pb.CreateTableResponse:
        self.data.check_map(request.shard_map)
        spec = table_spec_from_pb(request.spec)
        return pb.CreateTableResponse(created=self.shard.create_table(spec, may_create=self._may_create()))

    @_rpc
    def DescribeTable(self, request: pb.DescribeTableRequest, context: grpc.ServicerContext) -> pb.TableInfo:
        return convert.table_info(self.shard.describe(request.name))

    @_rpc
    def DropTable(self, request: pb.DropTableRequest, context: grpc.ServicerContext) -> pb.DropTableResponse:
        return pb.DropTableResponse(dropped=self.shard.drop(request.name))

    @_rpc
    def RegisterDense(self, request: pb.RegisterDenseRequest, context: grpc.ServicerContext) -> pb.RegisterDenseResponse:
        self.data.check_map(request.shard_map)
        values = convert.grads(request.values, "values") if request.HasField("values") else None
        created, initialized = self.shard.register_dense(dense_spec_from_pb(request.spec), request.row_start, values,
                                                         may_create=self._may_create())
        return pb.RegisterDenseResponse(created=created, initialized=initialized)

    @_rpc
    def Assign(self, request: pb.AssignRequest, context: grpc.ServicerContext) -> pb.AssignResponse:
        self.data.check_map(request.shard_map)
        values = convert.grads(request.values, "values")
        return pb.AssignResponse(version=self.shard.assign(request.table, convert.ids(request.ids), values))

    # ---- the data path (shardps.server.rpc.data_path) ----------------------------------

    @_rpc
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> bytes:
        return cast(bytes, self.data.pull(request))  # (bytes on a gRPC thread: only the data plane's are not)

    @_rpc
    def Push(self, request: bytes, context: grpc.ServicerContext) -> pb.PushResponse:
        return self.data.push(request, dense=False)

    @_rpc
    def PullDense(self, request: pb.PullDenseRequest, context: grpc.ServicerContext) -> bytes:
        return cast(bytes, self.data.pull_dense(request))  # (bytes on a gRPC thread: only the data plane's are not)

    @_rpc
    def PushDense(self, request: bytes, context: grpc.ServicerContext) -> pb.PushResponse:
        return self.data.push(request, dense=True)

    @_rpc
    def PullBatch(self, request: pb.PullBatchRequest, context: grpc.ServicerContext) -> bytes:
        return cast(bytes, self.data.pull_batch(request))  # (bytes on a gRPC thread: only the data plane's are not)

    @_rpc
    def PushBatch(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return cast(bytes, self.data.push_batch(request))  # (bytes on a gRPC thread: only the data plane's are not)

    def Stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serve pulls and pushes in the order they arrive on the stream, answering each in order.

        A refused call is answered with a StreamError and the stream goes on. A
        stream holds one handler thread while open, so at most ``max_streams`` are
        open at once; a client refused with RESOURCE_EXHAUSTED uses unary calls.
        """
        peer = context.peer()
        grant: Optional[Grant] = None
        try:
            if self.tokens is not None:  # the stream's token, checked once; each frame's method against its role
                grant = self.tokens.check(context.invocation_metadata(), "Pull")
            entered = self.callers.enter("streams", caller_limits(peer, grant, self.fairness.streams_per_connection,
                                                                  "max_streams"), "Stream")
        except Exception as e:  # noqa: BLE001 - UNAUTHENTICATED / PERMISSION_DENIED / RESOURCE_EXHAUSTED
            code, message, kind = self.chain.status(e, "Stream")
            self.chain.slow_refusal(peer, code)
            context.set_trailing_metadata(((status.KIND_METADATA, kind),))
            context.abort(code, message)
        try:
            self._open_stream(context)
            key, weight = (grant.key, grant.limits.weight) if grant is not None else (peer, 1.0)
            try:
                for request in requests:
                    yield self._stream_one(request, grant.role if grant else None, key, weight, peer)
            finally:
                with self._streams_lock:
                    self._streams.discard(context)
        finally:
            self.callers.exit("streams", entered)

    def Replicate(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[pb.ReplicaFrame]:
        """A backup follows this member, its group's primary (``shardps.server.rpc.replication``); an admin's call."""
        try:
            if self.tokens is not None:
                self.tokens.check(context.invocation_metadata(), "Replicate")
            yield from replication.serve(self.replica, (parse(pb.ReplicaAck, r) for r in requests), context)
        except Exception as e:  # noqa: BLE001 - every error becomes a status (the chain's table)
            if not context.is_active():
                return
            code, message, kind = self.chain.status(e, "Replicate")
            redirect = getattr(e, "redirect", "")
            context.set_trailing_metadata(((status.KIND_METADATA, kind),) +
                                          (((status.REDIRECT_METADATA, redirect),) if redirect else ()))
            context.abort(code, message)

    def _open_stream(self, context: grpc.ServicerContext) -> None:
        with self._streams_lock:
            if self._stopping:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"shard {self.shard.index}: shutting down")
            if len(self._streams) >= self.max_streams:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"shard {self.shard.index}: {self.max_streams} streams open (--max-streams); "
                              "use unary calls")
            self._streams.add(context)

    def _stream_one(self, request: bytes, role: Optional[str] = None, key: str = "local", weight: float = 1.0,
                    peer: str = "local") -> bytes:
        """One stream frame of a caller, answered (the chain's ``frame``; bytes on a gRPC thread)."""
        return cast(bytes, self.chain.frame(self.data.frames, request, role, key, weight, peer))

    def end_streams(self) -> None:
        """Refuse new streams and cancel the open ones (shutdown); clients resend what was not answered."""
        with self._streams_lock:
            self._stopping = True
            streams = list(self._streams)
        for context in streams:
            context.cancel()

    # ---- the control plane ---------------------------------------------------------------

    @_rpc
    def ShardInfo(self, request: pb.ShardInfoRequest, context: grpc.ServicerContext) -> pb.ShardInfoResponse:
        from shardps import __version__

        info = convert.shard_info(self.shard.info())
        info.server_version = f"shardps/{__version__}"
        if self.data_plane is not None:
            info.data_ports.extend(self.data_plane.ports)
            if self.data_plane.ipc:  # clients on this machine, in this network namespace, use Unix sockets
                info.local_scope = protocol.local_scope()
                info.data_ipc.extend(self.data_plane.ipc)
                info.data_regions = self.data_plane.regions > 0
            if request.data_session and self.data_plane.sessions is not None:  # over TLS: for one connection
                info.data_session_id, info.data_session_key = self.data_plane.sessions.issue()
            info.data_plane_handoffs = self.data_plane.handoffs
        for p, idle in self.chain.peers.recent():
            info.data_clients.add(peer=p.peer, transport=p.transport, caller=p.caller, calls=p.calls, bytes=p.bytes,
                                  idle_s=idle)
        if self.replica is not None:
            info.replica.CopyFrom(pb.ReplicaInfo(**self.replica.info()))
        info.slots.CopyFrom(migrate.slots_info(self.shard))
        return info

    @_rpc
    def Migrate(self, request: pb.MigrateRequest, context: grpc.ServicerContext) -> pb.MigrateResponse:
        return migrate.handle(self.shard, request)

    @_rpc
    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointResponse:
        phase = request.phase
        if phase == pb.CheckpointRequest.PREPARE:
            self.shard.prepare_checkpoint(request.hold_s)
            return pb.CheckpointResponse(checkpoint_id=request.checkpoint_id, version=self.shard.version)
        if phase == pb.CheckpointRequest.ABORT:
            self.shard.abort_checkpoint()
            return pb.CheckpointResponse(checkpoint_id=request.checkpoint_id, version=self.shard.version)
        prepared = phase == pb.CheckpointRequest.COMMIT
        cid, version, size, pause = self.shard.checkpoint(request.checkpoint_id, prepared=prepared)
        return pb.CheckpointResponse(checkpoint_id=cid, version=version, bytes=size, pause_s=pause)

    @_rpc
    def Export(self, request: pb.ExportRequest, context: grpc.ServicerContext) -> pb.ExportResponse:
        self.data.check_map(request.shard_map)
        phase, shard = request.phase, self.shard
        if phase == pb.ExportRequest.PREPARE:
            shard.hold_pushes(request.hold_s)
            return pb.ExportResponse(version=shard.version)
        if phase == pb.ExportRequest.ABORT:
            shard.abort_checkpoint()
            return pb.ExportResponse(version=shard.version)
        if phase == pb.ExportRequest.END:
            shard.export_end(request.export_id)
            return pb.ExportResponse()
        if phase == pb.ExportRequest.BEGIN:
            since = request.since_version if request.delta else None
            cut_map = shard.slots.map
            # After PREPARE (a cluster-wide cut) the copy resumes pushes; without it, this shard is copied now.
            begun = convert.export_begun(*shard.export_begin(request.export_id, list(request.tables),
                                                             request.optimizer_state, since,
                                                             prepared=not shard.gate.is_open))
            if shard.slots.map is not cut_map:  # a slot migration committed around the copy: its map is unknown
                shard.export_end(request.export_id)
                raise Unavailable(f"shard {shard.index}: its slot map changed during the export's copy; retry")
            begun.slot_map = json.dumps(cut_map.to_json(), separators=(",", ":"))
            return begun
        return convert.export_page(shard.export_read(request.export_id, request.table, request.offset,
                                                     request.max_rows, request.read_tombstones))

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        wait = request.wait_min_clock if request.HasField("wait_min_clock") else None
        wait_s = request.wait_s
        remaining = context.time_remaining()
        if remaining is not None:  # answer before the caller's deadline, with what there is by then (a margin
            wait_s = min(wait_s, max(0.0, remaining - max(0.5, remaining / 4)))  # for a busy machine's answer)
        if wait is None or not wait_s > 0:
            min_clock, live, gone = self.shard.heartbeat(request.rank, request.world_size, request.clock,
                                                         request.leaving, incarnation=request.incarnation,
                                                         generation=request.generation)
            return pb.HeartbeatResponse(min_clock=min_clock, live_ranks=live, gone_ranks=gone)
        # A waiting heartbeat holds a handler thread: a few per connection (and per token, where it sets a
        # limit); beyond max_streams waiting in all, a heartbeat answers at once with what there is.
        entered = self.callers.enter("waiting", caller_limits(context.peer(), self.chain.grant(),
                                                              self.fairness.waiting_per_connection, "max_waiting"),
                                     "Heartbeat")
        with self._streams_lock:
            if self._waiting >= self.max_streams:
                wait_s = 0.0
            self._waiting += 1
        try:
            min_clock, live, gone = self.shard.heartbeat(
                request.rank, request.world_size, request.clock, request.leaving, wait, wait_s,
                lambda: context.is_active() and not self._stopping, request.incarnation, request.generation,
            )
        finally:
            with self._streams_lock:
                self._waiting -= 1
            self.callers.exit("waiting", entered)
        return pb.HeartbeatResponse(min_clock=min_clock, live_ranks=live, gone_ranks=gone)


def add_to_server(servicer: ShardServicer, server: grpc.Server) -> None:
    """Register the Shard service. Requests arrive as bytes, parsed by the call chain, so a request that
    cannot be parsed is answered INVALID_ARGUMENT by us rather than INTERNAL by gRPC; the bulk methods'
    replies are already serialized (see shardps.core.wire)."""
    handlers = {}
    for m in protocol.METHODS.values():
        serialize = None if m.wire_response else m.response.SerializeToString
        make = grpc.stream_stream_rpc_method_handler if m.streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(getattr(servicer, m.name), request_deserializer=None, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(protocol.SERVICE, handlers),))
