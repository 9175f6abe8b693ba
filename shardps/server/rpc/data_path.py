"""The data path's handlers: pulls, pushes and their batches, for unary calls and stream frames alike.
A batch validates every entry before it applies any, so a refused batch changes nothing (the row pulls a PushBatch
carries are read after its pushes, and cannot refuse it)."""

from __future__ import annotations

from typing import Any, Callable

from shardps.core import codec, pushread, wire
from shardps.core.errors import Moved, ResourceExhausted, ShardError, StaleUpdate, SyncStepFailed
from shardps.core.wire import Buffer, parse
from shardps.server.rpc import convert
from shardps.server.shard.facade import Shard
from shardps.server.shard.updates import PushResult
from shardps.v1 import shardps_pb2 as pb


class DataPath:
    """Pull and push handlers of one shard; ``frames`` serves a stream frame of each data-path method."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        # How a stream frame of each method is served: (view, field) -> the reply framed as that field.
        self.frames: dict[str, Callable[[memoryview, int], wire.Buffer]] = {
            "Push": lambda view, field: wire.frame(field, self.push(view, dense=False).SerializeToString()),
            "PushDense": lambda view, field: wire.frame(field, self.push(view, dense=True).SerializeToString()),
            "PushBatch": lambda view, field: self.push_batch(view, frame=field),
            "Pull": lambda view, field: self.pull(parse(pb.PullRequest, view), frame=field),
            "PullDense": lambda view, field: self.pull_dense(parse(pb.PullDenseRequest, view), frame=field),
            "PullBatch": lambda view, field: self.pull_batch(parse(pb.PullBatchRequest, view), frame=field),
        }

    def check_map(self, shard_map: Any) -> None:
        if shard_map is not None:
            self.shard.check_shard_map(shard_map.shard_index, shard_map.num_shards, shard_map.map_epoch,
                                       shard_map.map_id)

    # ---- pulls -------------------------------------------------------------------------

    def pull(self, request: pb.PullRequest, frame: int = 0) -> wire.Buffer:
        self.check_map(request.shard_map)
        dtype = convert.wire_dtype(request.wire_dtype)
        answer, _ = self.shard.pull(request.table, convert.ids(request.ids), codec.NP_DTYPES[dtype].itemsize,
                                    lambda rows, at, version: wire.encode_pull_response(rows, dtype, version, frame, at))
        return answer

    def pull_dense(self, request: pb.PullDenseRequest, frame: int = 0) -> wire.Buffer:
        return self._read_dense(self._validated_pull_dense(request), frame)

    def _validated_pull_dense(self, request: pb.PullDenseRequest) -> tuple[Any, Any, int]:
        """Check a dense pull without reading it: (table, row ids, wire dtype)."""
        self.check_map(request.shard_map)
        dtype = convert.wire_dtype(request.wire_dtype)
        t, ids = self.shard.validate_pull_dense(request.name, request.row_start, request.row_end)
        self.shard.check_reply(t, ids.shape[0], codec.NP_DTYPES[dtype].itemsize)
        return t, ids, dtype

    def _read_dense(self, pull: tuple[Any, Any, int], frame: int = 0) -> wire.Buffer:
        t, ids, dtype = pull
        rows, version = self.shard.read_rows(t, ids)
        return wire.encode_pull_response(rows, dtype, version, frame)

    def pull_batch(self, request: pb.PullBatchRequest, frame: int = 0) -> wire.Buffer:
        replies: list[wire.Buffer] = []
        dense: list[wire.Buffer] = []
        total = 0
        limit = self.shard.limits.max_message_bytes
        for out, read, reqs in ((replies, self.pull, request.pulls), (dense, self.pull_dense, request.dense)):
            for req in reqs:
                out.append(read(req))
                total += len(out[-1])
                if total > limit:
                    raise ResourceExhausted(f"a PullBatch reply over {limit:,} bytes (--max-message-mb); "
                                            "split the batch")
        return wire.encode_repeated(
            [(pb.PullBatchResponse.PULLS_FIELD_NUMBER, replies), (pb.PullBatchResponse.DENSE_FIELD_NUMBER, dense)], frame)

    # ---- pushes ------------------------------------------------------------------------

    def push(self, request: Buffer, dense: bool) -> pb.PushResponse:
        """A serialized PushRequest (or PushDenseRequest), applied; ``request`` becomes the WAL record."""
        t, ids, d = self._validated_push(request, dense)
        return convert.push_response(self._apply(t, ids, d, request))

    def _validated_push(self, request: Buffer, dense: bool) -> tuple[Any, Any, Any]:
        """Decode and check a push without applying it: (table, row ids, decoded push); table None for a push this
        shard applied before (a resend: answered as a duplicate before ownership is checked, since its rows may
        have moved to another shard since, with the push in them)."""
        d = pushread.decode_push(request, dense=dense)
        self.check_map(d.shard_map)
        assert d.grads is not None
        if d.client_id and self.shard.updates.seen.contains(d.client_id, d.seq):
            return None, None, d
        if d.client_id and d.origins and self.shard.updates.elsewhere.applied(d.client_id, d.origins):
            return None, None, d  # planned again after a shard left unanswering: that shard applied it
        if dense:
            t, ids = self.shard.validate_push_dense(d.name, d.row_start, d.grads, convert.sync_part(d.sync))
        else:
            assert d.ids is not None
            t, ids = self.shard.validate_push(d.name, d.ids, d.grads, convert.sync_part(d.sync)), d.ids
        return t, ids, d

    def _apply(self, t: Any, ids: Any, d: Any, raw: Buffer) -> PushResult:
        if t is None:
            return self.shard.duplicate_push()
        return self.shard.apply_push(t, ids, d.grads, d.pulled_version, d.client_id, d.seq,
                                     convert.sync_part(d.sync), raw=raw)

    def push_batch(self, request: Buffer, frame: int = 0) -> wire.Buffer:
        """Apply a PushBatch's pushes in order, then read its dense pulls and its row pulls: a serialized
        PushBatchResponse (``frame``: as that field of an enclosing message, built in place on the data plane)."""
        pushes, dense_pushes, pull_dense, row_pulls = (pb.PushBatchRequest.PUSHES_FIELD_NUMBER,
                                                       pb.PushBatchRequest.DENSE_FIELD_NUMBER,
                                                       pb.PushBatchRequest.PULL_DENSE_FIELD_NUMBER,
                                                       pb.PushBatchRequest.PULLS_FIELD_NUMBER)
        groups = wire.decode_repeated(request, (pushes, dense_pushes, pull_dense, row_pulls))
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
            except Moved:  # its slots moved while it waited (a handover): not applied, and the entries before it
                # were, so the batch is not refused whole (its resend would apply them twice): marked for the client
                # to send this one again to the new owner.
                (out.dense if dense else out.pushes).append(pb.PushResponse(moved=True))
                continue
            (out.dense if dense else out.pushes).append(convert.push_response(r))
        if first_error is not None:
            raise first_error
        try:
            pulled = [self._read_dense(p) for p in pulls]
        except Moved:  # a chunk to read moved while the pushes waited: the pushes' outcomes stand (a batch refused
            # whole is sent again whole); the pulls are left out, and the client pulls them anew.
            pulled = []
        rows = self._carried_pulls(groups.get(row_pulls, []))
        # Repeated fields concatenate: the pulled values follow the outcomes as fields 3 and 4.
        return wire.encode_repeated([(pb.PushBatchResponse.PULLED_DENSE_FIELD_NUMBER, pulled),
                                     (pb.PushBatchResponse.PULLED_FIELD_NUMBER, rows)],
                                    frame, head=out.SerializeToString())

    def _carried_pulls(self, views: list[memoryview]) -> list[wire.Buffer]:
        """The row pulls a PushBatch carries, read after its pushes: all of them, or none when any cannot be served
        (the pushes' outcomes stand; the client pulls them anew, and hears the error then)."""
        out: list[wire.Buffer] = []
        total, limit = 0, self.shard.limits.max_message_bytes
        try:
            for view in views:
                out.append(self.pull(parse(pb.PullRequest, view)))
                total += len(out[-1])
                if total > limit:
                    return []
        except ShardError:
            return []
        return out
