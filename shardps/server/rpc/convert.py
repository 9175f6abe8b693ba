"""Protobuf to plain values and back, for the servicer: decoded tensors with their dtype checks, specs,
push outcomes, table and shard info, export pages. The shard behind it never sees protobuf."""

from __future__ import annotations

from typing import Any, Optional

from shardps.core import codec
from shardps.core.errors import InvalidArgument
from shardps.core.specs import DenseSpec, dense_spec_to_pb, table_spec_to_pb
from shardps.server.shard.export_sessions import ExportedCopy
from shardps.server.shard.facade import ShardInfo, TableInfo
from shardps.server.shard.sync import SyncPart
from shardps.server.shard.updates import Counters, PushResult
from shardps.v1 import shardps_pb2 as pb


def ids(t: pb.Tensor) -> Any:
    if t.dtype != pb.INT64:
        raise InvalidArgument(f"ids must be int64, got {codec.dtype_name(t.dtype)}")
    return codec.decode(t, "ids")


def grads(t: pb.Tensor, what: str = "grads") -> Any:
    if t.dtype not in codec.WIRE_FLOAT_DTYPES:
        raise InvalidArgument(f"{what} must be float32, float16 or bfloat16, got {codec.dtype_name(t.dtype)}")
    return codec.decode(t, what)


def wire_dtype(dtype: int) -> int:
    if dtype == pb.DTYPE_UNSPECIFIED:
        return pb.FLOAT32
    if dtype not in codec.WIRE_FLOAT_DTYPES:
        raise InvalidArgument(f"wire_dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def sync_part(p: Any) -> Optional[SyncPart]:
    if p is None:
        return None
    return SyncPart(step=p.step, rank=p.rank, part=p.part, parts=p.parts)


def push_response(r: PushResult) -> pb.PushResponse:
    return pb.PushResponse(version=r.version, staleness=r.staleness, duplicate=r.duplicate, late=r.late,
                           missing_ranks=r.missing_ranks)


def table_info(info: TableInfo) -> pb.TableInfo:
    out = pb.TableInfo(num_rows=info.num_rows, bytes=info.bytes, bytes_per_row=info.bytes_per_row,
                       payload_bytes=info.payload_bytes, admitted=info.admitted, rejected=info.rejected,
                       evicted_ttl=info.evicted_ttl, evicted_capacity=info.evicted_capacity,
                       sketch_bytes=info.sketch_bytes, hot_rows=info.hot_rows, disk_rows=info.disk_rows,
                       disk_bytes=info.disk_bytes, tier_hits=info.tier_hits, tier_misses=info.tier_misses,
                       promoted=info.promoted, written_back=info.written_back)
    set_spec(out, info.spec)
    return out


def set_spec(msg: Any, spec: Any) -> None:
    """Fill a message's ``dense`` field with a dense tensor's spec, or its ``spec`` field with a table's."""
    if isinstance(spec, DenseSpec):
        msg.dense.CopyFrom(dense_spec_to_pb(spec))
    else:
        msg.spec.CopyFrom(table_spec_to_pb(spec))


def stats(c: Counters) -> pb.ShardStats:
    return pb.ShardStats(
        pulls=c.pulls, pushes=c.pushes, rows_pulled=c.rows_pulled, rows_pushed=c.rows_pushed,
        stale_rejected=c.stale_rejected, duplicates=c.duplicates, max_staleness=c.max_staleness,
        mean_staleness=c.mean_staleness, errors=c.errors,
    )


def shard_info(info: ShardInfo) -> pb.ShardInfoResponse:
    out = pb.ShardInfoResponse(
        shard_index=info.shard_index, num_shards=info.num_shards, version=info.version,
        tables=[table_info(t) for t in info.tables], uptime_s=info.uptime_s, stats=stats(info.stats),
        durability=info.durability, last_checkpoint=info.last_checkpoint, export_floor=info.export_floor,
    )
    if info.serving is not None:
        out.serving.CopyFrom(info.serving.to_pb())
    return out


def export_begun(version: int, copies: dict[str, ExportedCopy]) -> pb.ExportResponse:
    out = pb.ExportResponse(version=version)
    for copy in copies.values():
        entry = out.tables.add(rows=copy.rows, full=copy.full, tombstones=copy.tombstones.shape[0])
        set_spec(entry, copy.spec)
    return out


def export_page(page: dict[str, Any]) -> pb.ExportResponse:
    page = dict(page)
    out = pb.ExportResponse(ids=codec.encode(page.pop("ids")))
    if "values" in page:
        out.values.CopyFrom(codec.encode(page.pop("values")))
    if "steps" in page:
        out.steps.CopyFrom(codec.encode(page.pop("steps")))
    for k, v in page.items():
        out.state[k[len("state."):]].CopyFrom(codec.encode(v))
    return out
