"""Hand-written protobuf wire encoding of the hot messages, without extra copies.

The bulk of pulls and pushes is one ``bytes`` field holding an array. Going
through protobuf objects copies it several times (array -> bytes -> message ->
serialized string on one side, string -> message -> bytes on the other).
These functions write the same wire format directly around the array's
buffer (one copy, into the message) and read it back as a ``numpy.frombuffer``
view of the received message (no copy). The output is byte-identical to
``SerializeToString`` of the generated classes, which the tests check, so any
protobuf implementation can talk to the shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from shardps import codec
from shardps.errors import InvalidArgument
from shardps.v1 import shardps_pb2 as pb

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
Buffer = Union[bytes, bytearray, memoryview]


def _encode_varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# Tags, dtypes, shape entries, lengths and sequence numbers are mostly small: look them up.
_SMALL_VARINTS = tuple(_encode_varint(n) for n in range(1 << 14))


def _varint(n: int) -> bytes:
    return _SMALL_VARINTS[n] if 0 <= n < 16384 else _encode_varint(n)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _len_field(field: int, parts: list) -> list:
    # Every part is bytes or a 1-D byte view (format "B"), so len() is its size in bytes.
    return [_tag(field, _LEN), _varint(sum(map(len, parts))), *parts]


def _tensor_parts(array: np.ndarray, dtype: int) -> list:
    """Fields of a Tensor message (dtype, packed shape, data) around the array's own buffer."""
    data = codec.wire_elements(array, dtype)
    parts: list = []
    if dtype:
        parts += [_tag(1, _VARINT), _varint(dtype)]
    if array.shape:
        packed = b"".join(_varint(int(s)) for s in array.shape)
        parts += [_tag(2, _LEN), _varint(len(packed)), packed]
    if data.nbytes:
        parts += [_tag(3, _LEN), _varint(data.nbytes), memoryview(data.reshape(-1)).cast("B")]
    return parts


def encode_pull_response(rows: np.ndarray, wire_dtype: int, version: int, frame: int = 0) -> bytes:
    """A serialized PullResponse{rows, version} (``frame``: as that field of an enclosing message)."""
    parts = _len_field(1, _tensor_parts(rows, wire_dtype))
    if version:
        parts += [_tag(2, _VARINT), _varint(version)]
    return b"".join(_len_field(frame, parts) if frame else parts)


def frame(field: int, *messages: Buffer) -> bytes:
    """``messages``, concatenated, as field ``field`` of an enclosing message (tag, length, bytes).

    Several already framed fields concatenate to one message: framed pushes make a
    PushBatchRequest that way.
    """
    return b"".join(_len_field(field, [m.cast("B") if isinstance(m, memoryview) else m for m in messages]))


def unframe(buf: Buffer) -> tuple[int, memoryview]:
    """The first length-delimited field of a message: (field number, view of its bytes)."""
    view = memoryview(buf)
    key, pos = _read_varint(view, 0)
    if key & 7 != _LEN:
        raise InvalidArgument(f"expected a length-delimited field, got wire type {key & 7}")
    size, pos = _read_varint(view, pos)
    if pos + size > view.nbytes:
        raise InvalidArgument("truncated message")
    return key >> 3, view[pos : pos + size]


def _string_field(field: int, s: str) -> list:
    return _len_field(field, [s.encode()]) if s else []


def _msg_field(field: int, msg: Optional[object]) -> list:
    if msg is None:
        return []
    return _len_field(field, [msg.SerializeToString()])  # type: ignore[attr-defined]


def encode_push(
    name: str, grads: np.ndarray, wire_dtype: int, *, ids: Optional[np.ndarray] = None, row_start: int = 0,
    pulled_version: Optional[int] = None, client_id: str = "", seq: int = 0,
    shard_map: Optional[pb.ShardMap] = None, sync: Optional[pb.SyncPart] = None, frame: int = 0,
) -> bytes:
    """A serialized PushRequest (with ``ids``) or PushDenseRequest (with ``row_start``).

    With ``frame``, the message is field ``frame`` of an enclosing message (built in
    the same pass, no extra copy): field 1 or 2 frames it both as a StreamRequest and
    as an entry of a PushBatchRequest.
    """
    parts = _string_field(1, name)
    if ids is not None:
        parts += _len_field(2, _tensor_parts(ids, pb.INT64))
    elif row_start:
        parts += [_tag(2, _VARINT), _varint(row_start)]
    parts += _len_field(3, _tensor_parts(grads, wire_dtype))
    if pulled_version is not None:
        parts += [_tag(4, _VARINT), _varint(pulled_version)]
    parts += _string_field(5, client_id)
    if seq:
        parts += [_tag(6, _VARINT), _varint(seq)]
    parts += _msg_field(7, shard_map)
    parts += _msg_field(8, sync)
    return b"".join(_len_field(frame, parts) if frame else parts)


# ---- decoding -------------------------------------------------------------------------------


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    if pos < len(buf) and buf[pos] < 0x80:  # one byte: most tags, dtypes and small numbers
        return buf[pos], pos + 1
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise InvalidArgument("malformed message: truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise InvalidArgument("malformed message: varint too long")


def _fields(buf: memoryview) -> list[tuple[int, int, Union[int, memoryview]]]:
    """(field number, wire type, value) of every field; LEN values are views into ``buf``."""
    out = []
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wt = key >> 3, key & 7
        value: Union[int, memoryview]
        if wt == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wt == _LEN:
            n, pos = _read_varint(buf, pos)
            if pos + n > end:
                raise InvalidArgument("malformed message: field runs past the end")
            value, pos = buf[pos : pos + n], pos + n
        elif wt == _I64:
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wt == _I32:
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise InvalidArgument(f"malformed message: wire type {wt}")
        out.append((field, wt, value))
    if pos != end:
        raise InvalidArgument("malformed message: trailing bytes")
    return out


def decode_tensor(buf: memoryview, what: str, as_float32: bool = True, allowed: Optional[tuple] = None) -> np.ndarray:
    """A Tensor message as a numpy view of ``buf`` (float16/bfloat16 widened to float32).

    ``allowed``: the dtypes accepted; another one is refused naming ``what``.
    """
    dtype, shape, data = 0, [], memoryview(b"")
    for field, wt, value in _fields(buf):
        if field == 1 and wt == _VARINT:
            dtype = int(value)  # type: ignore[arg-type]
        elif field == 2 and wt == _LEN:
            sub, pos = value, 0  # packed
            while pos < len(sub):  # type: ignore[arg-type]
                v, pos = _read_varint(sub, pos)  # type: ignore[arg-type]
                shape.append(v - (1 << 64) if v >= 1 << 63 else v)
        elif field == 2 and wt == _VARINT:
            shape.append(int(value))  # type: ignore[arg-type]
        elif field == 3 and wt == _LEN:
            data = value  # type: ignore[assignment]
    if allowed is not None and dtype not in allowed:
        names = [codec.DTYPE_NAMES[d] for d in allowed]
        expected = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise InvalidArgument(f"{what} must be {expected}, got {codec.DTYPE_NAMES.get(dtype, dtype)}")
    return codec.decode_raw(dtype, shape, data, what, as_float32)


def decode_pull_response(buf: Buffer) -> tuple[np.ndarray, int]:
    """(rows, version) of a serialized PullResponse; rows are float32 (a view when sent as float32)."""
    rows: Optional[np.ndarray] = None
    version = 0
    for field, wt, value in _fields(memoryview(buf)):
        if field == 1 and wt == _LEN:
            rows = decode_tensor(value, "rows")  # type: ignore[arg-type]
        elif field == 2 and wt == _VARINT:
            version = int(value)  # type: ignore[arg-type]
    if rows is None:
        rows = np.zeros((0,), np.float32)
    return rows, version


@dataclass
class DecodedPush:
    """The fields of a PushRequest or PushDenseRequest; arrays are views of the message."""

    name: str = ""
    ids: Optional[np.ndarray] = None
    row_start: int = 0
    grads: Optional[np.ndarray] = None
    pulled_version: Optional[int] = None
    client_id: str = ""
    seq: int = 0
    shard_map: Optional[pb.ShardMap] = None
    sync: Optional[pb.SyncPart] = None


def decode_push(buf: Buffer, dense: bool) -> DecodedPush:
    """Parse a serialized PushRequest (``dense=False``) or PushDenseRequest."""
    out = DecodedPush()
    try:
        for field, wt, value in _fields(memoryview(buf)):
            if field == 1 and wt == _LEN:
                out.name = bytes(value).decode()  # type: ignore[arg-type]
            elif field == 2:
                if dense and wt == _VARINT:
                    out.row_start = int(value)  # type: ignore[arg-type]
                elif not dense and wt == _LEN:
                    out.ids = decode_tensor(value, "ids", allowed=(pb.INT64,))  # type: ignore[arg-type]
            elif field == 3 and wt == _LEN:
                out.grads = decode_tensor(value, "grads", allowed=codec.WIRE_FLOAT_DTYPES)  # type: ignore[arg-type]
            elif field == 4 and wt == _VARINT:
                out.pulled_version = int(value)  # type: ignore[arg-type]
            elif field == 5 and wt == _LEN:
                out.client_id = bytes(value).decode()  # type: ignore[arg-type]
            elif field == 6 and wt == _VARINT:
                out.seq = int(value)  # type: ignore[arg-type]
            elif field == 7 and wt == _LEN:
                out.shard_map = pb.ShardMap.FromString(bytes(value))  # type: ignore[arg-type]
            elif field == 8 and wt == _LEN:
                out.sync = pb.SyncPart.FromString(bytes(value))  # type: ignore[arg-type]
    except UnicodeDecodeError:
        raise InvalidArgument("malformed message: invalid UTF-8 in a string field") from None
    if not dense and out.ids is None:
        out.ids = np.zeros(0, np.int64)
    if out.grads is None:
        raise InvalidArgument("grads: missing")
    return out


def encode_repeated(groups: list[tuple[int, list[bytes]]], frame: int = 0) -> bytes:
    """A message of repeated length-delimited fields: [(field, [serialized message, ...]), ...].

    With ``frame``, the message is field ``frame`` of an enclosing message.
    """
    parts: list = []
    for field, items in groups:
        for item in items:
            parts += _len_field(field, [item])
    return b"".join(_len_field(frame, parts) if frame else parts)


def decode_repeated(buf: Buffer) -> dict[int, list[memoryview]]:
    """Views of the length-delimited fields of a message, by field number (in order)."""
    out: dict[int, list[memoryview]] = {}
    for field, wt, value in _fields(memoryview(buf)):
        if wt == _LEN:
            out.setdefault(field, []).append(value)  # type: ignore[arg-type]
    return out
