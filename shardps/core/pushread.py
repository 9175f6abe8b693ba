"""Reading a push: ``decode_push`` of a PushRequest or PushDenseRequest into a ``DecodedPush``.

Two readers, one reading. A push in protobuf's one canonical form (what every shardps client writes: protobuf
serializes it back to the same bytes) is parsed by protobuf's C parser; any other is read field by field by the
strict reader (``wire._fields``), which refuses what protobuf could read another way. Either way what is accepted is
what protobuf reads, so the write-ahead log may hold the raw request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from google.protobuf.message import DecodeError

from shardps.core import codec
from shardps.core.errors import InvalidArgument
from shardps.core.wire import (
    _LEN,
    _P_CLIENT_ID,
    _P_GRADS,
    _P_IDS,
    _P_NAME,
    _P_ORIGINS,
    _P_PULLED_VERSION,
    _P_ROW_START,
    _P_SEQ,
    _P_SHARD_MAP,
    _P_SYNC,
    _VARINT,
    Buffer,
    _fields,
    _singular,
    _tensor,
    _view,
    decode_tensor,
    parse,
)
from shardps.v1 import shardps_pb2 as pb


@dataclass
class DecodedPush:
    """The fields of a PushRequest or PushDenseRequest; arrays are views (of the message, or of protobuf's copy of a
    field), never written to."""

    name: str = ""
    ids: Optional[np.ndarray] = None
    row_start: int = 0
    grads: Optional[np.ndarray] = None
    pulled_version: Optional[int] = None
    client_id: str = ""
    seq: int = 0
    shard_map: Optional[pb.ShardMap] = None
    sync: Optional[pb.SyncPart] = None
    origins: tuple[tuple[int, int], ...] = ()  # (shard, seq) where a push planned again was sent before


# Field -> wire type of PushRequest and PushDenseRequest (field 2: ids or row_start).
_PUSH = {_P_NAME: _LEN, _P_IDS: _LEN, _P_GRADS: _LEN, _P_PULLED_VERSION: _VARINT, _P_CLIENT_ID: _LEN,
         _P_SEQ: _VARINT, _P_SHARD_MAP: _LEN, _P_SYNC: _LEN}
_PUSH_DENSE = {**_PUSH, _P_ROW_START: _VARINT}


def _string(value: Any, what: str) -> str:
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise InvalidArgument(f"malformed message: {what} is not valid UTF-8") from None


# Pushes under this size are read by protobuf's parser when they are in its one canonical form (``canonical``);
# above it the copies that parser makes (the message, then each bytes field) cost more than reading field by field.
CANONICAL_PARSE_BYTES = 64 << 10


def decode_push(buf: Buffer, dense: bool) -> DecodedPush:
    """Parse a serialized PushRequest (``dense=False``) or PushDenseRequest: by protobuf's parser when it is
    canonical and under ``CANONICAL_PARSE_BYTES``, else field by field (``read_fields``); the same either way."""
    if len(buf) < CANONICAL_PARSE_BYTES:
        out = canonical(buf, dense)
        if out is not None:
            return out
    return read_fields(buf, dense)


def read_fields(buf: Buffer, dense: bool) -> DecodedPush:
    """``decode_push`` field by field, arrays as views of ``buf``.

    Strict (see ``wire._fields`` and ``wire._singular``): what this accepts, protobuf's own
    parser reads the same way, so the write-ahead log may hold the raw request.
    """
    fields = _fields(_view(buf))
    origins = [(wt, value) for field, wt, value in fields if field == _P_ORIGINS]  # (its one repeated field)
    f = _singular([x for x in fields if x[0] != _P_ORIGINS] if origins else fields,
                  _PUSH_DENSE if dense else _PUSH, "push")
    out = DecodedPush()
    if origins:
        if any(wt != _LEN for wt, _ in origins):
            raise InvalidArgument(f"malformed message: push field {_P_ORIGINS} has a wire type other than {_LEN}")
        parsed = [parse(pb.PushOrigin, v, "origins") for _, v in origins]  # type: ignore[arg-type]
        out.origins = tuple((int(o.shard), int(o.seq)) for o in parsed)
    if _P_NAME in f:
        out.name = _string(f[_P_NAME], "the table name")
    if _P_IDS in f:
        if dense:
            out.row_start = int(f[_P_ROW_START])  # type: ignore[arg-type]
        else:
            out.ids = decode_tensor(f[_P_IDS], "ids", allowed=(pb.INT64,))  # type: ignore[arg-type]
    if _P_GRADS in f:
        out.grads = decode_tensor(f[_P_GRADS], "grads", allowed=codec.WIRE_FLOAT_DTYPES)  # type: ignore[arg-type]
    if _P_PULLED_VERSION in f:
        out.pulled_version = int(f[_P_PULLED_VERSION])  # type: ignore[arg-type]
    if _P_CLIENT_ID in f:
        out.client_id = _string(f[_P_CLIENT_ID], "client_id")
    out.seq = int(f.get(_P_SEQ, 0))  # type: ignore[arg-type]
    if _P_SHARD_MAP in f:
        out.shard_map = parse(pb.ShardMap, f[_P_SHARD_MAP], "shard_map")  # type: ignore[arg-type]
    if _P_SYNC in f:
        out.sync = parse(pb.SyncPart, f[_P_SYNC], "sync")  # type: ignore[arg-type]
    if not dense and out.ids is None:
        out.ids = np.zeros(0, np.int64)
    if out.grads is None:
        raise InvalidArgument("grads: missing")
    return out


def canonical(buf: Buffer, dense: bool) -> Optional[DecodedPush]:
    """``decode_push`` by protobuf's C parser, for a push that protobuf serializes back to the very same bytes, its
    unknown fields left out (every shardps client writes that form). Such a message has one reading, field by field
    or not: no singular field twice, no overlong varint, no field of another wire type, its fields in order. So it is
    read as ``read_fields`` reads it; 11 against 21 us for a collection's push of 250 rows of 16. None for any other
    message: ``read_fields`` reads it, or names what is wrong with it."""
    raw = bytes(buf)
    try:
        m = (pb.PushDenseRequest if dense else pb.PushRequest).FromString(raw)
        m.DiscardUnknownFields()  # (a known field of another wire type is one to protobuf: the strict reader refuses it)
        if m.SerializeToString(deterministic=True) != raw:
            return None
        name, client_id = (m.name if dense else m.table), m.client_id
    except (DecodeError, UnicodeDecodeError):
        return None
    out = DecodedPush(name=name, client_id=client_id, seq=m.seq)
    if dense:
        out.row_start = m.row_start
    elif m.HasField("ids"):
        t = m.ids
        out.ids = _tensor(t.dtype, t.shape, t.data, "ids", allowed=(pb.INT64,))
    else:
        out.ids = np.zeros(0, np.int64)
    if not m.HasField("grads"):
        raise InvalidArgument("grads: missing")
    t = m.grads
    out.grads = _tensor(t.dtype, t.shape, t.data, "grads", allowed=codec.WIRE_FLOAT_DTYPES)
    if m.HasField("pulled_version"):
        out.pulled_version = m.pulled_version
    if m.HasField("shard_map"):
        out.shard_map = m.shard_map
    if m.HasField("sync"):
        out.sync = m.sync
    if m.origins:
        out.origins = tuple((int(o.shard), int(o.seq)) for o in m.origins)
    return out
