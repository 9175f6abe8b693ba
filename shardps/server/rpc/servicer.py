"""gRPC servicer: decode the request, call the shard, encode the reply.

Exceptions become status codes here and only here (``_status``, from the status table
``shardps.core.status``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional, TypeVar

import grpc

from shardps.core import codec, protocol, status, wire
from shardps.core.errors import (
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    StaleUpdate,
    SyncStepFailed,
    clip,
)
from shardps.core.specs import DenseSpec, dense_spec_from_pb, dense_spec_to_pb, table_spec_from_pb, table_spec_to_pb
from shardps.core.wire import Buffer, parse
from shardps.server.rpc import fair
from shardps.server.rpc.auth import ALLOWED, Grant, Tokens
from shardps.server.rpc.fair import Callers, FairConfig, FairScheduler
from shardps.server.shard.facade import Shard, ShardInfo, TableInfo
from shardps.server.shard.sync import SyncPart
from shardps.server.shard.updates import Counters, PushResult
from shardps.v1 import shardps_pb2 as pb
from shardps.v1 import shardps_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
# The data path: these calls take turns in fair order (shardps.server.rpc.fair); the others are cheap or wait.
GATED = frozenset({"Pull", "Push", "PullDense", "PushDense", "PullBatch", "PushBatch"})
# Refusals that a well-behaved client rarely gets: a caller getting many has them slowed down.
PENALIZED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                       grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})
MAX_ERROR_CHARS = 1024  # status details travel in metadata (8 KiB by default): never echo a request into it


def _rpc(method: F) -> F:
    """Run a servicer method on the raw request: check the caller's token, take a fair turn (data-path
    calls), parse the request (unless the method reads the wire itself), and turn every error into a
    status code; counted in the shard's metrics."""
    name = method.__name__
    spec = protocol.METHODS[name]
    request_type, raw = spec.request, spec.wire_request
    gated = name in GATED

    @functools.wraps(method)
    def wrapper(self: ShardServicer, request: bytes, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        peer = context.peer()
        try:
            grant = None
            if self.tokens is not None:  # before the request is decoded
                grant = self._local.grant = self.tokens.check(context.invocation_metadata(), name)
                self.callers.enter("calls", [(grant.key, grant.limits.max_calls)], name)
            key, weight = (grant.key, grant.limits.weight) if grant else (peer, 1.0)
            try:
                if gated:
                    self.scheduler.acquire(key, weight)
                result = method(self, request if raw else parse(request_type, request), context)
            finally:
                fair.release()
                if grant is not None:
                    self.callers.exit("calls", [grant.key])
            if gated:
                self.scheduler.charge(key, weight, 0.0, len(request) + _size(result))
        except Exception as e:  # noqa: BLE001 - every error becomes a status (see _status)
            code, message, kind = self._status(e, name)
            self._slow_refusal(peer, code, len(request))
            if kind:
                context.set_trailing_metadata(((status.KIND_METADATA, kind),))
            context.abort(code, message)
        metrics = self.shard.metrics
        if metrics.enabled:
            metrics.call(name, time.perf_counter() - started, len(request), _size(result))
        return result

    return wrapper  # type: ignore[return-value]


def _size(reply: Any) -> int:
    return len(reply) if isinstance(reply, (bytes, bytearray, memoryview)) else reply.ByteSize()


def _ids(t: pb.Tensor) -> Any:
    if t.dtype != pb.INT64:
        raise InvalidArgument(f"ids must be int64, got {codec.dtype_name(t.dtype)}")
    return codec.decode(t, "ids")


def _grads(t: pb.Tensor, what: str = "grads") -> Any:
    if t.dtype not in codec.WIRE_FLOAT_DTYPES:
        raise InvalidArgument(f"{what} must be float32, float16 or bfloat16, got {codec.dtype_name(t.dtype)}")
    return codec.decode(t, what)


def _wire(dtype: int) -> int:
    if dtype == pb.DTYPE_UNSPECIFIED:
        return pb.FLOAT32
    if dtype not in codec.WIRE_FLOAT_DTYPES:
        raise InvalidArgument(f"wire_dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def _sync(p: Any) -> Any:
    if p is None:
        return None
    return SyncPart(step=p.step, rank=p.rank, part=p.part, parts=p.parts)


def _push_response(r: PushResult) -> pb.PushResponse:
    return pb.PushResponse(version=r.version, staleness=r.staleness, duplicate=r.duplicate, late=r.late,
                           missing_ranks=r.missing_ranks)


def _table_info(info: TableInfo) -> pb.TableInfo:
    out = pb.TableInfo(num_rows=info.num_rows, bytes=info.bytes, bytes_per_row=info.bytes_per_row,
                       payload_bytes=info.payload_bytes, admitted=info.admitted, rejected=info.rejected,
                       evicted_ttl=info.evicted_ttl, evicted_capacity=info.evicted_capacity,
                       sketch_bytes=info.sketch_bytes)
    _set_spec(out, info.spec)
    return out


def _set_spec(msg: Any, spec: Any) -> None:
    """Fill a message's ``dense`` field with a dense tensor's spec, or its ``spec`` field with a table's."""
    if isinstance(spec, DenseSpec):
        msg.dense.CopyFrom(dense_spec_to_pb(spec))
    else:
        msg.spec.CopyFrom(table_spec_to_pb(spec))


def _stats(c: Counters) -> pb.ShardStats:
    return pb.ShardStats(
        pulls=c.pulls, pushes=c.pushes, rows_pulled=c.rows_pulled, rows_pushed=c.rows_pushed,
        stale_rejected=c.stale_rejected, duplicates=c.duplicates, max_staleness=c.max_staleness,
        mean_staleness=c.mean_staleness, errors=c.errors,
    )


def _shard_info(info: ShardInfo) -> pb.ShardInfoResponse:
    out = pb.ShardInfoResponse(
        shard_index=info.shard_index, num_shards=info.num_shards, version=info.version,
        tables=[_table_info(t) for t in info.tables], uptime_s=info.uptime_s, stats=_stats(info.stats),
        durability=info.durability, last_checkpoint=info.last_checkpoint, export_floor=info.export_floor,
    )
    if info.serving is not None:
        out.serving.CopyFrom(info.serving.to_pb())
    return out


class ShardServicer(pb_grpc.ShardServicer):
    """The ``shardps.v1.Shard`` service over one ``Shard``."""

    def __init__(self, shard: Shard, max_streams: int = 64, tokens: Optional[Tokens] = None,
                 fairness: FairConfig = FairConfig()) -> None:
        self.shard = shard
        self.max_streams = max_streams
        self.tokens = tokens  # None: every call allowed (no tokens file)
        self.fairness = fairness
        self.scheduler = FairScheduler(fairness.slots)
        self.callers = Callers()
        self._waiting = 0  # heartbeats waiting for other workers, all callers
        self._local = threading.local()  # the grant of the call this handler thread serves
        self._streams: set[grpc.ServicerContext] = set()
        self._streams_lock = threading.Lock()
        self._stopping = False
        # How a stream frame of each method is served: (view, field) -> the reply framed as that field.
        self._frames: dict[str, Callable[[memoryview, int], bytes]] = {
            "Push": lambda view, field: wire.frame(field, self._push(view, dense=False).SerializeToString()),
            "PushDense": lambda view, field: wire.frame(field, self._push(view, dense=True).SerializeToString()),
            "PushBatch": lambda view, field: wire.frame(field, self._push_batch(view)),
            "Pull": lambda view, field: self._pull(parse(pb.PullRequest, view), frame=field),
            "PullDense": lambda view, field: self._pull_dense(parse(pb.PullDenseRequest, view), frame=field),
            "PullBatch": lambda view, field: self._pull_batch(parse(pb.PullBatchRequest, view), frame=field),
        }

    def _may_create(self) -> bool:
        """Whether this call may create a table or dense tensor (an admin's token, or no tokens at all)."""
        grant: Optional[Grant] = getattr(self._local, "grant", None)
        return self.tokens is None or (grant is not None and grant.role == "admin")

    @staticmethod
    def _limits(peer: str, grant: Optional[Grant], per_connection: int, token_limit: str) -> list[tuple[str, Optional[int]]]:
        """The callers a stream or waiting call counts against: its connection, and its token if any."""
        limits: list[tuple[str, Optional[int]]] = [(peer, per_connection)]
        if grant is not None:
            limits.append((grant.key, getattr(grant.limits, token_limit)))
        return limits

    def _slow_refusal(self, connection: str, code: grpc.StatusCode, nbytes: int = 0) -> None:
        """A refusal a well-behaved client rarely gets waits a little when its connection gets many
        (shardps.server.rpc.fair): a flood of malformed or unauthenticated calls then costs the shard little."""
        if code in PENALIZED:
            delay = self.callers.failed(connection, nbytes)
            if delay:
                time.sleep(delay)

    def _check_map(self, shard_map: Any) -> None:
        if shard_map is not None:
            self.shard.check_shard_map(shard_map.shard_index, shard_map.num_shards)

    @_rpc
    def CreateTable(self, request: pb.CreateTableRequest, context: grpc.ServicerContext) -> pb.CreateTableResponse:
        self._check_map(request.shard_map)
        spec = table_spec_from_pb(request.spec)
        return pb.CreateTableResponse(created=self.shard.create_table(spec, may_create=self._may_create()))

    @_rpc
    def DescribeTable(self, request: pb.DescribeTableRequest, context: grpc.ServicerContext) -> pb.TableInfo:
        return _table_info(self.shard.describe(request.name))

    @_rpc
    def DropTable(self, request: pb.DropTableRequest, context: grpc.ServicerContext) -> pb.DropTableResponse:
        return pb.DropTableResponse(dropped=self.shard.drop(request.name))

    @_rpc
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> bytes:
        return self._pull(request)

    def _pull(self, request: pb.PullRequest, frame: int = 0) -> bytes:
        self._check_map(request.shard_map)
        wire_dtype = _wire(request.wire_dtype)
        rows, version = self.shard.pull(request.table, _ids(request.ids), codec.NP_DTYPES[wire_dtype].itemsize)
        return wire.encode_pull_response(rows, wire_dtype, version, frame)

    def _status(self, e: Exception, method: str) -> tuple[grpc.StatusCode, str, str]:
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

    @_rpc
    def Push(self, request: bytes, context: grpc.ServicerContext) -> pb.PushResponse:
        return self._push(request, dense=False)

    def _push(self, request: Buffer, dense: bool) -> pb.PushResponse:
        """A serialized PushRequest (or PushDenseRequest), applied; ``request`` becomes the WAL record."""
        t, ids, d = self._validated_push(request, dense)
        return _push_response(self._apply(t, ids, d, request))

    def _validated_push(self, request: Buffer, dense: bool) -> tuple[Any, Any, Any]:
        """Decode and check a push without applying it: (table, row ids, decoded push)."""
        d = wire.decode_push(request, dense=dense)
        self._check_map(d.shard_map)
        assert d.grads is not None
        if dense:
            t, ids = self.shard.validate_push_dense(d.name, d.row_start, d.grads, _sync(d.sync))
        else:
            assert d.ids is not None
            t, ids = self.shard.validate_push(d.name, d.ids, d.grads, _sync(d.sync)), d.ids
        return t, ids, d

    def _apply(self, t: Any, ids: Any, d: Any, raw: Buffer) -> PushResult:
        return self.shard.apply_push(t, ids, d.grads, d.pulled_version, d.client_id, d.seq, _sync(d.sync), raw=raw)

    @_rpc
    def RegisterDense(self, request: pb.RegisterDenseRequest, context: grpc.ServicerContext) -> pb.RegisterDenseResponse:
        self._check_map(request.shard_map)
        values = _grads(request.values, "values") if request.HasField("values") else None
        created, initialized = self.shard.register_dense(dense_spec_from_pb(request.spec), request.row_start, values,
                                                         may_create=self._may_create())
        return pb.RegisterDenseResponse(created=created, initialized=initialized)

    @_rpc
    def PullDense(self, request: pb.PullDenseRequest, context: grpc.ServicerContext) -> bytes:
        return self._pull_dense(request)

    def _pull_dense(self, request: pb.PullDenseRequest, frame: int = 0) -> bytes:
        return self._read_dense(self._validated_pull_dense(request), frame)

    def _validated_pull_dense(self, request: pb.PullDenseRequest) -> tuple[Any, Any, int]:
        """Check a dense pull without reading it: (table, row ids, wire dtype)."""
        self._check_map(request.shard_map)
        wire_dtype = _wire(request.wire_dtype)
        t, ids = self.shard.validate_pull_dense(request.name, request.row_start, request.row_end)
        self.shard.check_reply(t, ids.shape[0], codec.NP_DTYPES[wire_dtype].itemsize)
        return t, ids, wire_dtype

    def _read_dense(self, pull: tuple[Any, Any, int], frame: int = 0) -> bytes:
        t, ids, wire_dtype = pull
        rows, version = self.shard.read_rows(t, ids)
        return wire.encode_pull_response(rows, wire_dtype, version, frame)

    @_rpc
    def PushDense(self, request: bytes, context: grpc.ServicerContext) -> pb.PushResponse:
        return self._push(request, dense=True)

    @_rpc
    def PullBatch(self, request: pb.PullBatchRequest, context: grpc.ServicerContext) -> bytes:
        return self._pull_batch(request)

    def _pull_batch(self, request: pb.PullBatchRequest, frame: int = 0) -> bytes:
        replies: list[bytes] = []
        dense: list[bytes] = []
        total = 0
        for out, read, reqs in ((replies, self._pull, request.pulls), (dense, self._pull_dense, request.dense)):
            for req in reqs:
                out.append(read(req))
                total += len(out[-1])
                if total > self.shard.limits.max_message_bytes:
                    raise ResourceExhausted(f"a PullBatch reply over {self.shard.limits.max_message_bytes:,} bytes "
                                            "(--max-message-mb); split the batch")
        return wire.encode_repeated(
            [(pb.PullBatchResponse.PULLS_FIELD_NUMBER, replies), (pb.PullBatchResponse.DENSE_FIELD_NUMBER, dense)], frame)

    @_rpc
    def PushBatch(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return self._push_batch(request)

    def _push_batch(self, request: Buffer) -> bytes:
        """Apply a PushBatch's pushes in order, then read its dense pulls: a serialized PushBatchResponse."""
        pushes, dense_pushes, pull_dense = (pb.PushBatchRequest.PUSHES_FIELD_NUMBER,
                                            pb.PushBatchRequest.DENSE_FIELD_NUMBER,
                                            pb.PushBatchRequest.PULL_DENSE_FIELD_NUMBER)
        groups = wire.decode_repeated(request, (pushes, dense_pushes, pull_dense))
        entries = []
        for field, dense in ((pushes, False), (dense_pushes, True)):  # validate everything before applying anything
            for view in groups.get(field, []):
                entries.append((dense, *self._validated_push(view, dense), view))
        pulls = [self._validated_pull_dense(parse(pb.PullDenseRequest, view)) for view in groups.get(pull_dense, [])]
        out = pb.PushBatchResponse()
        first_error: Any = None
        for dense, t, ids, d, view in entries:
            try:
                r = self._apply(t, ids, d, view)
            except (StaleUpdate, SyncStepFailed) as e:  # this entry alone is refused, as a push of its own would be
                first_error = first_error or e
                continue
            (out.dense if dense else out.pushes).append(_push_response(r))
        if first_error is not None:
            raise first_error
        # Repeated fields concatenate: the pulled values follow the outcomes as field 3.
        return out.SerializeToString() + wire.encode_repeated(
            [(pb.PushBatchResponse.PULLED_DENSE_FIELD_NUMBER, [self._read_dense(p) for p in pulls])])

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
            entered = self.callers.enter("streams", self._limits(peer, grant, self.fairness.streams_per_connection,
                                                                 "max_streams"), "Stream")
        except Exception as e:  # noqa: BLE001 - UNAUTHENTICATED / PERMISSION_DENIED / RESOURCE_EXHAUSTED
            code, message, kind = self._status(e, "Stream")
            self._slow_refusal(peer, code)
            context.set_trailing_metadata(((status.KIND_METADATA, kind),))
            context.abort(code, message)
        try:
            with self._streams_lock:
                if self._stopping:
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"shard {self.shard.index}: shutting down")
                if len(self._streams) >= self.max_streams:
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"shard {self.shard.index}: {self.max_streams} streams open (--max-streams); "
                                  "use unary calls")
                self._streams.add(context)
            key, weight = (grant.key, grant.limits.weight) if grant is not None else (peer, 1.0)
            try:
                for request in requests:
                    yield self._stream_one(request, grant.role if grant else None, key, weight, peer)
            finally:
                with self._streams_lock:
                    self._streams.discard(context)
        finally:
            self.callers.exit("streams", entered)

    def _stream_one(self, request: bytes, role: Optional[str] = None, key: str = "local", weight: float = 1.0,
                    peer: str = "local") -> bytes:
        """One stream frame of a caller (``key``, its fair-share weight; ``peer``, its connection), answered."""
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
                reply = self._frames[name](view, field)  # framed as the StreamResponse field of that number
            finally:
                fair.release()
            self.scheduler.charge(key, weight, 0.0, len(request) + len(reply))
            if self.shard.metrics.enabled:
                self.shard.metrics.call(name, time.perf_counter() - started, len(request), len(reply))
            return reply
        except Exception as e:  # noqa: BLE001 - answered with a StreamError; the stream goes on
            code, message, kind = self._status(e, name)
        self._slow_refusal(peer, code, len(request))
        return pb.StreamResponse(error=pb.StreamError(code=code.value[0], message=message, kind=kind)).SerializeToString()

    def end_streams(self) -> None:
        """Refuse new streams and cancel the open ones (shutdown); clients resend what was not answered."""
        with self._streams_lock:
            self._stopping = True
            streams = list(self._streams)
        for context in streams:
            context.cancel()

    @_rpc
    def ShardInfo(self, request: pb.ShardInfoRequest, context: grpc.ServicerContext) -> pb.ShardInfoResponse:
        from shardps import __version__

        info = _shard_info(self.shard.info())
        info.server_version = f"shardps/{__version__}"
        return info

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
        self._check_map(request.shard_map)
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
            # After PREPARE (a cluster-wide cut) the copy resumes pushes; without it, this shard is copied now.
            version, copies = shard.export_begin(request.export_id, list(request.tables), request.optimizer_state,
                                                 since, prepared=not shard.gate.is_open)
            out = pb.ExportResponse(version=version)
            for copy in copies.values():
                entry = out.tables.add(rows=copy.arrays["ids"].shape[0], full=copy.full,
                                       tombstones=copy.arrays["tombstones"].shape[0] if "tombstones" in copy.arrays else 0)
                _set_spec(entry, copy.spec)
            return out
        page = shard.export_read(request.export_id, request.table, request.offset, request.max_rows,
                                 request.read_tombstones)
        out = pb.ExportResponse(ids=codec.encode(page.pop("ids")))
        if "values" in page:
            out.values.CopyFrom(codec.encode(page.pop("values")))
        if "steps" in page:
            out.steps.CopyFrom(codec.encode(page.pop("steps")))
        for k, v in page.items():
            out.state[k[len("state."):]].CopyFrom(codec.encode(v))
        return out

    @_rpc
    def Assign(self, request: pb.AssignRequest, context: grpc.ServicerContext) -> pb.AssignResponse:
        self._check_map(request.shard_map)
        values = _grads(request.values, "values")
        return pb.AssignResponse(version=self.shard.assign(request.table, _ids(request.ids), values))

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        wait = request.wait_min_clock if request.HasField("wait_min_clock") else None
        wait_s = request.wait_s
        remaining = context.time_remaining()
        if remaining is not None:  # answer before the caller's deadline, with what there is by then
            wait_s = min(wait_s, max(0.0, remaining - 0.5))
        if wait is None or not wait_s > 0:
            min_clock, live, gone = self.shard.heartbeat(request.rank, request.world_size, request.clock,
                                                         request.leaving)
            return pb.HeartbeatResponse(min_clock=min_clock, live_ranks=live, gone_ranks=gone)
        # A waiting heartbeat holds a handler thread: a few per connection (and per token, where it sets a
        # limit); beyond max_streams waiting in all, a heartbeat answers at once with what there is.
        peer, grant = context.peer(), getattr(self._local, "grant", None) if self.tokens is not None else None
        entered = self.callers.enter("waiting", self._limits(peer, grant, self.fairness.waiting_per_connection,
                                                             "max_waiting"), "Heartbeat")
        with self._streams_lock:
            if self._waiting >= self.max_streams:
                wait_s = 0.0
            self._waiting += 1
        try:
            min_clock, live, gone = self.shard.heartbeat(
                request.rank, request.world_size, request.clock, request.leaving, wait, wait_s,
                lambda: context.is_active() and not self._stopping,
            )
        finally:
            with self._streams_lock:
                self._waiting -= 1
            self.callers.exit("waiting", entered)
        return pb.HeartbeatResponse(min_clock=min_clock, live_ranks=live, gone_ranks=gone)


def add_to_server(servicer: ShardServicer, server: grpc.Server) -> None:
    """Register the Shard service. Requests arrive as bytes, parsed by the servicer (``_rpc``), so a
    request that cannot be parsed is answered INVALID_ARGUMENT by us rather than INTERNAL by gRPC;
    the bulk methods' replies are already serialized (see shardps.core.wire)."""
    handlers = {}
    for m in protocol.METHODS.values():
        serialize = None if m.wire_response else m.response.SerializeToString
        make = grpc.stream_stream_rpc_method_handler if m.streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(getattr(servicer, m.name), request_deserializer=None, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(protocol.SERVICE, handlers),))
